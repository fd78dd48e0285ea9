"""Tensor parallelism: one target sharded over several devices with torch.distributed.

``LLM(..., tensor_parallel_size=N)`` (or ``--tensor-parallel-size N``) runs the target on N ranks: rank 0
is the engine, the others run its passes on their shards. Files: ``rank_shard.py`` (which slice each rank
holds), ``layers.py`` (the sharded layers and model), ``shards.py`` (loading a rank's slices),
``groups.py`` (the device and control groups), ``steps.py`` (the step metadata rank 0 broadcasts),
``runner.py`` (rank 0's runner and the other ranks' loop), ``launch.py`` (starting the ranks, or joining
torchrun's).
"""
from saguaro.parallel.groups import TensorParallelError
from saguaro.parallel.rank_shard import ShardError, RankShard, rank_shard

__all__ = ["ShardError", "RankShard", "TensorParallelError", "rank_shard"]
