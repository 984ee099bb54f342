"""The inference engine: sequences, paged KV blocks with prefix caching, a continuous-batching scheduler."""

from tether.block_hash import hash_block
from tether.engine.block_manager import BlockCopy, BlockManager, BlockManagerStats, slot_mapping
from tether.engine.config import EngineConfig, PreemptionMode
from tether.engine.scheduler import RequestError, Scheduler
from tether.engine.scheduler_output import ScheduledChunk, SchedulerOutput
from tether.engine.sequence import FinishReason, Sequence, SequenceStatus

__all__ = [
    "BlockCopy",
    "BlockManager",
    "BlockManagerStats",
    "EngineConfig",
    "FinishReason",
    "PreemptionMode",
    "RequestError",
    "ScheduledChunk",
    "Scheduler",
    "SchedulerOutput",
    "Sequence",
    "SequenceStatus",
    "hash_block",
    "slot_mapping",
]
