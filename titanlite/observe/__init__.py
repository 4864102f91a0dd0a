"""What a run reports about itself: the step log and TensorBoard, Weights & Biases, profiling, the start-up summary."""
