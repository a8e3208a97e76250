"""Asynchronous pipeline parallelism (PipeDream 1F1B, PipeDream-2BW, a uniform delay; schedules are
values, ``pipeline_sim.schedules``), emulated and across devices, the paper's baselines and the
field's staleness remedies (weight prediction, delay compensation)."""

from pipeline_sim.baselines import (
    nesterov,
    nesterov_stage_b1,
    per_stage,
    pipedream,
    pipedream_lr,
    pipemare_lr_schedule,
    scale_by_nadam_torch,
)
from pipeline_sim.delays import (
    StageOptimizers,
    check_labels,
    leaf_delays,
    merge_stages,
    num_stages_of,
    split_stages,
    stage_delays,
)
from pipeline_sim.devices import (
    DEVICE_MODES,
    DevicePipeline,
    DevicePipelineState,
    Versions,
    pipeline_mesh,
)
from pipeline_sim.diagnostics import diagnose
from pipeline_sim.driver import MODES, Pipeline, PipelineState
from pipeline_sim.gradients import OtherStageError, Staged, no_stashing_value_and_grad
from pipeline_sim.protocol import PipelineProtocol
from pipeline_sim.remedies import DelayCompensationState, dc_asgd
from pipeline_sim.schedules import SCHEDULES, OneFOneB, Schedule, TwoBW, UniformDelay, schedule_of
from pipeline_sim.sharding import data_mesh, fsdp, replicate, shard_batches

__all__ = [
    "DEVICE_MODES", "SCHEDULES", "DelayCompensationState", "DevicePipeline", "DevicePipelineState",
    "MODES", "Pipeline", "OtherStageError", "PipelineProtocol", "PipelineState", "Schedule", "Staged",
    "check_labels", "data_mesh", "dc_asgd", "diagnose", "fsdp", "leaf_delays", "merge_stages",
    "nesterov", "nesterov_stage_b1", "no_stashing_value_and_grad", "num_stages_of", "per_stage",
    "pipedream", "pipedream_lr", "pipeline_mesh", "pipemare_lr_schedule", "replicate",
    "scale_by_nadam_torch", "shard_batches", "split_stages", "stage_delays", "OneFOneB", "TwoBW",
    "UniformDelay", "StageOptimizers", "Versions", "schedule_of"
]
