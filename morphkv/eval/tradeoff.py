"""``python -m morphkv.eval.tradeoff docs/figures``: bytes_tradeoff.png, recall on the natural
and canned test items (``recall_natural_test.json``, ``recall_canned_test.json``) against the
held-out KL ratio to StreamingLLM(128, float32) (``bytes_heldout.json``), per arm at 2.81 MiB."""

import json
import sys


def main(fig_dir: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nat = json.load(open(f"{fig_dir}/recall_natural_test.json"))["summary"]
    can = json.load(open(f"{fig_dir}/recall_canned_test.json"))["summary"]
    kl = {s["arm"]: s for s in json.load(open(f"{fig_dir}/bytes_heldout.json"))["summary"]}
    same = ("h2o", "streaming_llm:memory=f16:bits=8", "recommended:memory=f16",
            "recommended:memory=f16:peak=1")
    arms = {**{a: a for a in same}, "rotating": "streaming_llm"}  # recall arm -> KL arm
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.3), sharey=False)
    for ax, summ, title in ((axes[0], nat, "natural chats (test)"),
                            (axes[1], can, "canned chats (test)")):
        rows = {r["arm"]: r for r in summ["rows"]}
        for arm, klarm in arms.items():
            r, k = rows[arm], kl[klarm]
            lo, hi = r["interval"]
            ax.errorbar(k["mean_ratio"], 100 * r["accuracy"],
                        yerr=[[100 * (r["accuracy"] - lo)], [100 * (hi - r["accuracy"])]],
                        fmt="o", capsize=3, label=f"{arm} ({k['mib']:.2f} MiB)")
        ax.set_xscale("log")
        ax.set_xlabel("held-out mean KL / StreamingLLM(128, float32)'s (lower is better)")
        ax.set_ylabel(f"recall, % of {summ['full_correct']} items the full cache answers")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="center right")
    fig.suptitle("Equal bytes: 2.81 MiB = a float16 cache of 128 tokens "
                 "(baselines: 128 float32 tokens, 5.7-6.0 MiB)")
    fig.tight_layout()
    fig.savefig(f"{fig_dir}/bytes_tradeoff.png", dpi=120)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "docs/figures")
