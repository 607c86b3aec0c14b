"""Tensor-parallel generation across processes or machines, the way mlx_lm shards models.

Under ``mlx.launch`` (ring over TCP, MPI, ...) every rank loads the whole model, then
``model.shard(group)`` keeps 1/N of each layer's attention heads (KV heads included) and of
its MLP, with an all-reduce after the output projections. morphkv's eviction is per KV head,
so each rank's caches bound and score only its own KV heads: nothing else changes, and each
rank stores 1/N of the KV bytes. Embeddings, norms and the LM head are replicated; so is
the token sampling (every rank computes the same logits and picks the same token).

    mlx.launch -n 3 --backend ring -- morphkv generate --prompt "..."   # one machine
    mlx.launch --hostfile hosts.json -- morphkv generate --prompt "..." # several

Python: ``group = shard_if_launched(model)`` after loading, before building caches.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import mlx.core as mx

# Set by the launchers mlx.distributed.init() reads (ring/jaccl: MLX_RANK; MPI; NCCL).
LAUNCH_ENV = ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "MLX_WORLD_SIZE")


def launched() -> bool:
    """Whether this process was started by a distributed launcher (``mlx.launch``, mpirun)."""
    return any(name in os.environ for name in LAUNCH_ENV)


def distributed_group() -> mx.distributed.Group | None:
    """This process's group when launched as one of several ranks, else ``None``."""
    if not launched() or not mx.distributed.is_available():
        return None
    group = mx.distributed.init()
    return group if group.size() > 1 else None


def _attention_heads(model: Any) -> list[tuple[int, int]]:
    """(query heads, KV heads) of each layer that has them."""
    heads = []
    for layer in getattr(model, "layers", []):
        attn = getattr(layer, "self_attn", None)
        n_heads, n_kv = getattr(attn, "n_heads", None), getattr(attn, "n_kv_heads", None)
        if n_heads and n_kv:
            heads.append((n_heads, n_kv))
    return heads


def check_shardable(model: Any, size: int) -> None:
    """Raise ``ValueError`` unless ``model.shard`` can split it ``size`` ways evenly."""
    name = type(model).__module__
    if not callable(getattr(model, "shard", None)):
        raise ValueError(f"{name} has no tensor-parallel shard(); it cannot run across ranks")
    for n_heads, n_kv in _attention_heads(model):
        if n_heads % size or n_kv % size:
            raise ValueError(
                f"{name}: {n_heads} attention heads and {n_kv} KV heads do not split evenly "
                f"across {size} ranks; launch a number of ranks that divides {n_kv}"
            )


def shard_model(model: Any, group: mx.distributed.Group) -> Any:
    """Shard ``model`` across ``group`` (checked first: nothing changes on bad input), load
    its weights and wait for every rank. Returns the model."""
    check_shardable(model, group.size())
    model.shard(group)
    mx.eval(model.parameters())
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))  # sync
    return model


def is_main(group: mx.distributed.Group | None) -> bool:
    """True on rank 0, and when not distributed."""
    return group is None or group.rank() == 0


def quiet_unless_main(group: mx.distributed.Group | None) -> None:
    """Send this rank's stdout to /dev/null unless it is rank 0 (stderr is kept)."""
    if not is_main(group):
        sys.stdout.flush()
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process


def shard_if_launched(model: Any, *, quiet: bool = True) -> mx.distributed.Group | None:
    """Under ``mlx.launch`` with several ranks: shard ``model`` across them and (``quiet``)
    print only on rank 0. Returns the group, or ``None`` (a single process: nothing done).
    Exits with a message naming the problem when the model cannot be split that way."""
    group = distributed_group()
    if group is None:
        return None
    try:
        shard_model(model, group)
    except ValueError as e:
        print(f"morphkv: error (rank {group.rank()}): {e}", file=sys.stderr)
        raise SystemExit(2) from e
    if quiet:
        quiet_unless_main(group)
    return group
