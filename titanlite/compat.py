"""The torch versions titanlite admits (2.11 to 2.15), and every private or version-dependent torch API it uses.

Nothing else in titanlite imports a private torch module: when a torch release moves one, this is the file
to change. Tested: torch 2.13 (CPU) runs the whole suite in CI; 2.14.1 and 2.15.0 passed the fast subset and
the parity tests once (README); torch 2.11 (CUDA 13, one H200) ran the GPU check (docs/performance.md). 2.12 is
admitted but not tested here.
"""

from __future__ import annotations

import os
import zlib
from contextlib import contextmanager, nullcontext
from functools import lru_cache
from unittest import mock

import torch

SUPPORTED = ((2, 11), (2, 16))  # [lowest, past the highest) minor versions, as pyproject.toml admits


def torch_version() -> tuple[int, int]:
    """(major, minor) of the installed torch."""
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def version_warning() -> str | None:
    """A warning when the installed torch is outside the admitted range (a source checkout bypasses pip)."""
    low, high = SUPPORTED
    if low <= torch_version() < high:
        return None
    return (
        f"torch {torch.__version__} is outside the versions titanlite admits (>= {low[0]}.{low[1]}, "
        f"< {high[0]}.{high[1]}); it may work, but nothing here was tested with it"
    )


def fake_store():
    """A store for torch's fake process group (the dry run sizes a job without real ranks)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # private: kept here

    return FakeStore()


def cpp_compiler_error() -> Exception | None:
    """The error inductor raises when it finds no C++ compiler (it needs one on CPU), or the OSError of one that
    cannot run (CXX naming something that is not a compiler), or None. Only those: any other error is a bug of this
    probe or of inductor and propagates (never a silent "no compiler")."""
    from torch._inductor.cpp_builder import get_cpp_compiler  # private; lazy: inductor is heavy
    from torch._inductor.exc import InvalidCxxCompiler

    try:
        get_cpp_compiler()
    except (InvalidCxxCompiler, OSError) as e:
        return e
    return None


def has_triton() -> bool:
    """Whether triton (inductor's GPU code generator) is installed and usable."""
    from torch.utils._triton import has_triton as _has_triton  # private; lazy: as above

    return _has_triton()


@lru_cache(maxsize=1)
def compiled_create_block_mask():
    """FlexAttention's create_block_mask under torch.compile, as torch asks since 2.11 (the `_compile=True`
    flag is deprecated there): the mask is built on the GPU without materialising a seq x seq tensor."""
    from torch.nn.attention.flex_attention import create_block_mask  # lazy: pulls in the compiler

    return torch.compile(create_block_mask)


def consolidate_hf_safetensors():
    """DCP's consolidation of HF safetensors shards on every rank (private in DCP)."""
    from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files_on_every_rank

    return consolidate_safetensors_files_on_every_rank


def fsspec_writer(path: str, crcs: dict | None = None, **kwargs):
    """DCP's storage writer over fsspec (object storage): a public class in a private module. crcs: filled with
    {file name: CRC-32 of its bytes}, computed as they are written, for each file whose upload completed."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    writer = FsspecWriter(path, **kwargs)
    if crcs is None:
        return writer
    opened = writer.fs.create_stream  # what the writer's threads open every file with (FileSystemWriter._write_data)

    @contextmanager
    def create_stream(name, mode: str):
        with opened(name, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            counted = _Crc32Writer(stream)
            yield counted
            counted.close()  # the upload completes here (a second close is a no-op)
            crcs[os.path.basename(os.fspath(name))] = counted.crc

    writer.fs.create_stream = create_stream
    return writer


class _Crc32Writer:
    """A binary stream that keeps the CRC-32 of the bytes written through it."""

    def __init__(self, raw):
        self.raw, self.crc = raw, 0

    def write(self, data) -> int:
        self.crc = zlib.crc32(data, self.crc)
        return self.raw.write(data)

    def __getattr__(self, name: str):
        return getattr(self.raw, name)


def fsspec_reader_class():
    """DCP's FsspecReader class (to subclass; it lives in a private module)."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader


def set_nested_element(root, path, value) -> None:
    """Put `value` at `path` of a nested state dict (DCP's own helper for flattened state dicts; private)."""
    from torch.distributed.checkpoint._traverse import set_element

    set_element(root, path, value)


def resolve_async_collective(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as a plain tensor when it is the AsyncCollectiveTensor wrapper that DTensor's functional
    collectives return (private in torch), with autograd intact; otherwise `tensor` itself.

    Fed to a compiled module, the wrapper loses the gradient that flows back into it (torch 2.13: the
    embedding's gradient under tensor parallelism was zero). Any non-view op waits and unwraps it.
    """
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return tensor.clone() if isinstance(tensor, AsyncCollectiveTensor) else tensor


def local_rows(t: torch.Tensor) -> tuple[int, int]:
    """(global index of the first row of dim 0 this rank holds, how many) of a DTensor split over dim 0 only (FSDP,
    expert parallelism); (0, all) for a plain tensor."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # private

    if not isinstance(t, DTensor):
        return 0, t.shape[0]
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return offset[0], shape[0]


def all_gather_autograd(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's x of `group` stacked along dim 0, differentiable (backward reduce-scatters) and traceable by
    torch.compile: functional collectives' all_gather_single_autograd (torch 2.13; all_gather_tensor_autograd
    before, deprecated since)."""
    import torch.distributed._functional_collectives as funcol

    gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
    return gather(x, 0, group)


def forward_only_schedule(stages: list, n_microbatches: int, loss_fn, stage_to_rank: dict[int, int]):
    """A torch pipeline schedule over several stages per rank that runs forwards only (evaluation): each rank its
    stages in order, every microbatch of one before the next; the last stage computes loss_fn. torch's multi-stage
    schedules (Interleaved1F1B, ZBVZeroBubble) cannot run forward-only (torch 2.13): this lowers a plan of forwards
    to torch's runtime actions (FSDP unshards, sends and receives) with torch's own private helpers, as they do
    (their checks require every backward, so they are not called)."""
    from torch.distributed.pipelining import schedules as ps

    class ForwardOnly(ps._PipelineScheduleRuntime):
        def __init__(self):
            super().__init__(stages=stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
            self._has_backward = False
            self.stage_index_to_group_rank = dict(stage_to_rank)
            for stage in self._stages:
                stage.stage_index_to_group_rank = self.stage_index_to_group_rank
            forward = ps._ComputationType.FORWARD
            self.pipeline_order = {
                rank: [
                    ps._Action(i, forward, mb)
                    for i in sorted(s for s, r in stage_to_rank.items() if r == rank)
                    for mb in range(n_microbatches)
                ]
                for rank in sorted(set(stage_to_rank.values()))
            }
            self.pipeline_order_with_comms = ps._add_send_recv(
                {rank: ps._add_unshard_reshard(actions) for rank, actions in self.pipeline_order.items()},
                stage_to_rank=lambda s: self.stage_index_to_group_rank[s],
                num_stages=self._num_stages,
            )

    return ForwardOnly()


# The names torch's PipelineStage gives the forward it runs once to learn the stages' shapes (2.13; earlier releases).
SHAPE_LEARNING_FORWARDS = ("_forward_metadata_inference", "_shape_inference")


@contextmanager
def _metadata_inference(module):
    """Marks the module (`inferring`) while torch's pipeline stage runs it once to learn its shapes: that forward is
    not a step's (an MoE must not count its loads)."""
    module.inferring = True
    try:
        yield
    finally:
        module.inferring = False


@lru_cache(maxsize=1)
def pipeline_stage_class():
    """torch's PipelineStage, whose gradient reduction after a local batch keeps the delayed all-reduce (torch's turns
    FSDP's gradient sync on, which also turns the all-reduce across replicas back on: its internal
    perform_reduce_grad is overridden, torch 2.11-2.15), and whose shape-learning forward is marked on the stage
    module. Built on first use: torch.distributed.pipelining imports the compiler stack."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.pipelining import PipelineStage

    class PipelineStageKeepingAllReduce(PipelineStage):
        all_reduce = True  # False before the last accumulation microbatch (gradient_sync = delay_all_reduce)

        def perform_reduce_grad(self, grad_scale_factor: int) -> None:
            root = self.submod
            if self.all_reduce or not isinstance(root, FSDPModule):
                return super().perform_reduce_grad(grad_scale_factor)
            turn_on = root.set_requires_gradient_sync

            def sync_without_all_reduce(requires: bool, *, recurse: bool = True) -> None:
                turn_on(requires, recurse=recurse)
                root.set_requires_all_reduce(False, recurse=recurse)

            root.set_requires_gradient_sync = sync_without_all_reduce
            try:
                super().perform_reduce_grad(grad_scale_factor)
            finally:
                del root.set_requires_gradient_sync

    for name in SHAPE_LEARNING_FORWARDS:
        if hasattr(PipelineStage, name):
            setattr(PipelineStageKeepingAllReduce, name, _marked(getattr(PipelineStage, name)))
    return PipelineStageKeepingAllReduce


def _marked(learn_shapes):
    def run(self, *args, **kwargs):
        with _metadata_inference(self.submod):
            return learn_shapes(self, *args, **kwargs)

    return run


def set_exit_barrier_timeout(seconds: float) -> None:
    """How long torchrun's agent waits, once its workers are done, for the other nodes' agents (its private
    LocalElasticAgent's exit_barrier_timeout, 300 s in torch): a node whose launcher was stopped by a signal never
    arrives, and the other nodes would linger that long after their workers saved and exited. A torch whose agent
    has no such keyword is left as it is."""
    import inspect

    import torch.distributed.launcher.api as launcher_api
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    if "exit_barrier_timeout" not in inspect.signature(LocalElasticAgent.__init__).parameters:
        return

    class _Agent(LocalElasticAgent):
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("exit_barrier_timeout", seconds)
            super().__init__(*args, **kwargs)

    launcher_api.LocalElasticAgent = _Agent


def stop_signal_once() -> None:
    """torchrun's agent acts on its first stop signal only (torch's private _terminate_process_handler raises
    SignalException at every one). A second one that arrives while the agent shuts its workers down, as under SLURM,
    which signals every process of a step while run_train.sh passes the signal on too, broke that shutdown with a
    traceback and a failed exit: the job was not requeued though every rank had saved. Later ones are ignored: the
    shutdown under way ends the workers (its timeout then kills what is left). A torch without the handler is left
    as it is."""
    from torch.distributed.elastic.multiprocessing import api

    handler = getattr(api, "_terminate_process_handler", None)
    if handler is None or getattr(handler, "once", False):
        return
    seen = []

    def once(signum, frame):
        if not seen:
            seen.append(signum)
            handler(signum, frame)  # raises SignalException

    once.once = True
    api._terminate_process_handler = once


def forget_failed_quorum(manager) -> None:
    """Let a torchft Manager ask for a new quorum after one failed: torchft 0.2 keeps the failed request (its private
    _quorum_future) and raises its error again at every later start_quorum."""
    manager._quorum_future = None


def quorum_id(manager) -> int | None:
    """The id of a torchft Manager's current quorum (its private _quorum_id), the same for every group of a quorum;
    None before the first."""
    return getattr(manager, "_quorum_id", None)


def transformers_load(model, folder: str, files: list[str], take: dict | None = None):
    """transformers' own loading of safetensors `files` into `model` (its renamings, fused experts, DTensor shards
    read in place); its report (missing_keys, unexpected_keys, mismatched_keys). take: state-dict name -> a function
    that gets that tensor whole as read (QLoRA's 4-bit weights, quantized whole), one at a time, instead of the model.
    Private API of transformers 5.x (PreTrainedModel._load_pretrained_model and core_model_loading's
    set_param_for_module): its from_pretrained builds a new model, titanlite's is built sharded."""
    from transformers import core_model_loading
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming
    from transformers.modeling_utils import LoadStateDictConfig
    from transformers.utils import logging as transformers_logging

    # a multimodal folder's text model under older prefixes (Gemma 3's; the class's own mapping takes newer ones)
    text_model = [
        WeightRenaming(r"^language_model\.model\.", "model."),
        WeightRenaming(r"^language_model\.lm_head\.", "lm_head."),
        WeightRenaming(r"^model\.language_model\.", "model."),
    ]
    config = LoadStateDictConfig(
        pretrained_model_name_or_path=folder, weight_mapping=text_model + get_model_conversion_mapping(model)
    )
    transformers_logging.disable_progress_bar()
    set_param = core_model_loading.set_param_for_module

    def set_or_take(model_, target_name, value, loading_info, quantizer):
        if take and target_name in take:
            loading_info.missing_keys.discard(target_name)
            expected = model_.get_parameter(target_name).shape
            if value.shape != expected:
                loading_info.mismatched_keys.add((target_name, value.shape, expected))
                return None
            take[target_name](value.detach() if isinstance(value, torch.nn.Parameter) else value)
            return None
        return set_param(model_, target_name, value, loading_info, quantizer)

    core_model_loading.set_param_for_module = set_or_take
    try:  # taken tensors are read whole: one at a time, not read ahead by transformers' loading threads
        one_at_a_time = mock.patch.dict(os.environ, {"HF_DEACTIVATE_ASYNC_LOAD": "1"}) if take else nullcontext()
        with one_at_a_time:  # (patch.dict restores by clearing the whole environment: only when it must)
            info, _ = type(model)._load_pretrained_model(model, None, files, config)
    finally:
        core_model_loading.set_param_for_module = set_param
    # what it recorded for saving would write the folder's layout back (a multimodal one's prefixes): the export is
    # the text class's own layout, as for a model built from its config
    vars(model).pop("_weight_conversions", None)
    return info


@contextmanager
def one_sequence_per_row():
    """transformers' attention masks built as for rows of one sequence each (sdpa's is_causal, no mask), also on fake
    tensors, where its check of the positions (masking_utils.find_packed_sequence_indices) takes them for a trace and
    builds a mask a real run does not."""
    from transformers import masking_utils

    find = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = find
