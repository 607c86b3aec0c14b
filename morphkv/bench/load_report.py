"""Summary and figure of ``morphkv bench serve --scenario load`` (see ``morphkv.bench.load``)."""

from __future__ import annotations

from pathlib import Path

from ..eval import plots


def _at(memory: list, t: float) -> tuple | None:
    """The last memory sample at or before time ``t``."""
    before = [m for m in memory if m[0] <= t]
    return before[-1] if before else (memory[0] if memory else None)


def _size(x: str | int | None) -> int | None:
    if x is None:
        return None
    from mlx_lm.utils import _parse_size

    return int(_parse_size(str(x)))


def summarize(results: dict, args) -> dict:
    out = {}
    limit = _size(args.prompt_cache_bytes)
    for kind, r in results.items():
        phases, marks, memory = r["phases"], r["marks"], r["memory"]
        loads = [v for k, v in phases.items() if k.startswith("load_")]
        warm, end = _at(memory, marks.get("warm", 0)), _at(memory, marks.get("end", 1e18))
        s = {key: sum(p[key] for k, p in phases.items() if k != "probe")
             for key in ("requests", "failed_good", "responses_5xx")}
        s |= {
            "bad_4xx": f"{sum(p['bad_4xx'] for p in loads)}/{sum(p['bad'] for p in loads)}",
            "dropped_streams": sum(p["dropped"] for p in loads),
            "exit_status": r["exit_status"],
            "tracebacks_in_log": r["tracebacks_in_log"],
        }
        if warm and end:
            for n, i in (("rss", 1), ("mlx_peak", 3), ("mlx_active", 2)):
                s[f"{n}_after_warmup_mib"], s[f"{n}_end_mib"] = warm[i] / 2**20, end[i] / 2**20
                s[f"{n}_growth"] = end[i] / warm[i] - 1
            s["memory_at_marks_mib"] = {  # (RSS, MLX active, MLX peak) at the end of each phase
                name: [round(x / 2**20, 1) for x in _at(memory, t)[1:]]
                for name, t in sorted(marks.items(), key=lambda kv: kv[1])}
        if r["prompt_cache"]:
            s["prompt_cache_max_bytes"] = max(n for _, n in r["prompt_cache"])
            s["prompt_cache_limit_bytes"] = limit
            s["prompt_cache_samples"] = len(r["prompt_cache"])
        probe = phases.get("probe", [])
        s["probe"] = {p["name"]: p["status"] for p in probe}
        s["probe_4xx"] = sum(1 for p in probe[:-1] if p["status"] and 400 <= p["status"] < 500)
        s["probe_total"] = len(probe) - 1
        out[kind] = s
    if {"morphkv", "mlx_lm"} <= set(results):
        m, b = results["morphkv"]["phases"], results["mlx_lm"]["phases"]
        ratio = {p: m[p]["tokens_per_s"] / b[p]["tokens_per_s"] for p in m
                 if p != "probe" and p in b and b[p]["tokens_per_s"]}
        past_m = m.get("conversations_8", {}).get("past_4x_tokens_per_s")
        past_b = b.get("conversations_8", {}).get("past_4x_tokens_per_s")
        if past_m and past_b:
            ratio["conversations_8_past_4x_budget"] = past_m / past_b
        out["throughput_morphkv_over_mlx_lm"] = ratio
    return out


def plot(results: dict, args, path: Path) -> None:
    fig, axes = plots.panels(4, 5, 4.4)
    axes = axes[0]
    names = None
    for i, (kind, r) in enumerate(results.items()):
        phases = {k: v for k, v in r["phases"].items() if k != "probe"}
        names = list(phases)
        xs = [j + 0.4 * i for j in range(len(names))]
        axes[0].bar(xs, [p["tokens_per_s"] for p in phases.values()], 0.4, label=kind)
        axes[1].bar(xs, [p["p95_s"] or 0 for p in phases.values()], 0.4, label=f"{kind} p95")
        axes[1].bar(xs, [p["p50_s"] or 0 for p in phases.values()], 0.25, label=f"{kind} p50",
                    color="black", alpha=0.35 + 0.3 * i)
        mem = r["memory"]
        if mem:
            t0 = mem[0][0]
            axes[2].plot([m[0] - t0 for m in mem], [m[1] / 2**20 for m in mem], label=f"{kind} RSS")
            axes[2].plot([m[0] - t0 for m in mem], [m[3] / 2**20 for m in mem], ls="--",
                         label=f"{kind} MLX peak")
        if r["prompt_cache"]:
            t0 = r["prompt_cache"][0][0]
            axes[3].plot([t - t0 for t, _ in r["prompt_cache"]],
                         [n / 2**20 for _, n in r["prompt_cache"]], label=f"{kind} prompt cache")
    limit = _size(args.prompt_cache_bytes)
    if limit:
        axes[3].axhline(limit / 2**20, color="red", ls=":", label="--prompt-cache-bytes")
    for ax in axes[:2]:
        ax.set_xticks(range(len(names or [])), names or [], rotation=20)
    for ax, (x, y) in zip(axes, [("phase", "completion tokens/s"), ("phase", "request latency "
                                 "(s)"), ("seconds since start", "server memory (MiB)"),
                                 ("seconds", "prompt cache (MiB, sum of nbytes)")], strict=True):
        ax.set(xlabel=x, ylabel=y)
        ax.legend(fontsize=7)
    fig.suptitle(f"morphkv serve (budget {args.budget}) vs mlx_lm server (default cache): "
                 f"load and faults, max_tokens {args.max_tokens}")
    plots.save(fig, path, 110)

