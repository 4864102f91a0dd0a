"""What keeps a job safe on a cluster: process group set-up, run control, early stops, exit status, the hang watch."""
