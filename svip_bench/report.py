"""Aggregates benchmark runs into per-category, per-method numbers, and writes them as JSON, a
markdown table and PNG plots."""

from __future__ import annotations

import json
import statistics
from collections import Counter
from pathlib import Path

from svip_bench import hindsight
from svip_bench.hindsight import ALL, per_repeat_tps
from svip_bench.methods import HEAD_PREFIX, Method, Run

COST_RATIOS = (0.02, 0.05, 0.1, 0.2)
ENTROPY_BANDS = (0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 99.0)


def summarize(runs: list[Run], baseline: list[Run]) -> dict:
    tps = per_repeat_tps(runs)
    base = per_repeat_tps(baseline)
    speedups = [tps[r] / base[r] for r in tps if r in base]
    tokens = sum(len(r.token_ids) for r in runs)
    target_fwd = sum(r.target_forwards for r in runs)
    draft_fwd = sum(r.draft_forwards for r in runs)
    out = {
        "tokens_per_s": _med(list(tps.values())),
        "speedup": _med(speedups),
        "target_forwards_per_token": target_fwd / tokens,
        "draft_forwards_per_token": draft_fwd / tokens,
        "projected_speedup": {str(c): tokens / (target_fwd + c * draft_fwd) for c in COST_RATIOS},
    }
    ours = [r for r in runs if r.rounds is not None]
    if ours:
        rounds = sum(r.rounds for r in ours)
        drafted = sum(r.draft_tokens for r in ours)
        accepted = sum(r.accepted_tokens for r in ours)
        lengths = Counter(n for r in ours for n in r.draft_lengths)
        out.update(
            mean_acceptance_length=1 + accepted / rounds,
            acceptance_rate=accepted / drafted if drafted else None,
            draft_tokens_per_token=drafted / tokens,
            draft_length_histogram={str(k): lengths[k] for k in sorted(lengths)},
            mean_draft_length=drafted / rounds,
        )
    return out


def _med(values: list[float]) -> dict:
    if not values:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def aggregate(runs: list[Run], methods: list[Method]) -> dict:
    categories = sorted({r.category for r in runs}) + [ALL]
    table = {}
    for cat in categories:
        in_cat = [r for r in runs if cat == ALL or r.category == cat]
        baseline = [r for r in in_cat if r.method == "target"]
        table[cat] = {m.name: summarize([r for r in in_cat if r.method == m.name], baseline) for m in methods
                      if any(r.method == m.name for r in in_cat)}
    return table


def best_constant(table: dict, family_prefix: str = "constant-") -> str | None:
    overall = table[ALL]
    names = [n for n in overall if n.startswith(family_prefix)]
    return max(names, key=lambda n: overall[n]["speedup"]["median"]) if names else None


def entropy_acceptance(runs: list[Run], head: bool = False) -> list[dict]:
    """Acceptance rate of drafted tokens by the draft's entropy band (tokens whose prefix the
    target had accepted, from the project's own runs): the small draft's, or the feature head's."""
    bands = []
    pairs = [p for r in runs if r.method.startswith(HEAD_PREFIX) == head for p in r.entropy_acceptance]
    for lo, hi in zip(ENTROPY_BANDS, ENTROPY_BANDS[1:]):
        inside = [ok for h, ok in pairs if lo <= h < hi]
        bands.append({"band": f"[{lo}, {hi if hi < 99 else 'inf'})", "low": lo, "high": hi,
                      "tokens": len(inside), "acceptance": sum(inside) / len(inside) if inside else None})
    return bands


KEY_METHODS = ("target", "heuristic", "confidence", "svip", "svip-auto", "auto", "defaults", "oracle", "hf-heuristic")
HEAD_METHODS = tuple(HEAD_PREFIX + m for m in ("heuristic", "confidence", "svip", "auto", "oracle"))


def head_summary(table: dict) -> dict | None:
    """The feature draft against the small draft, and SVIP on it against its best constant depth
    and the heuristic (the paper's "SVIP on EAGLE" comparison), overall medians; None: no head rows."""
    overall = table[ALL]
    best_head = best_constant(table, HEAD_PREFIX + "constant-")
    if best_head is None:
        return None

    def speedup(name):
        return overall[name]["speedup"]["median"] if name in overall else None

    def best(names):
        names = [n for n in names if n in overall and n not in ("target", "oracle", HEAD_PREFIX + "oracle")]
        return max(names, key=speedup) if names else None

    small = best([n for n in overall if not n.startswith((HEAD_PREFIX, "hf-"))])
    head = best([n for n in overall if n.startswith(HEAD_PREFIX)])
    svip = speedup(HEAD_PREFIX + "svip")
    return {
        "best_small_draft": small, "best_small_draft_speedup": speedup(small),
        "best_head": head, "best_head_speedup": speedup(head),
        "head_over_small_draft": speedup(head) / speedup(small) if small and head else None,
        "best_head_constant": best_head, "head_svip_over_best_constant": svip / speedup(best_head) if svip else None,
        "head_svip_over_heuristic": (svip / speedup(HEAD_PREFIX + "heuristic")
                                     if svip and speedup(HEAD_PREFIX + "heuristic") else None),
    }


def markdown(table: dict, header: dict, learnt: dict | None = None) -> str:
    best = best_constant(table)
    best_hf = f"hf-constant-{best.split('-')[1]}" if best else None
    grid = [n for n in table[ALL] if n.startswith(("svip-", "confidence-")) and n != "svip-auto"]
    best_head = best_constant(table, HEAD_PREFIX + "constant-")
    head_grid = [n for n in table[ALL] if n.startswith(HEAD_PREFIX + "svip-")]
    shown = [m for m in ("target", best, *KEY_METHODS[1:], *grid, best_hf, best_head, *HEAD_METHODS, *head_grid) if m]
    lines = [f"Command: `{header['command']}`", f"Machine: {header['machine']}",
             f"Models: target {header['target']}, draft {header['draft']}; {header['prompts']} prompts, "
             f"{header['repeats']} repeats, {header['max_new_tokens']} new tokens, greedy"
             + (f"; feature head {header['head']} (rows {HEAD_PREFIX}*)" if header.get("head") else ""), ""]
    lines.append(
        "| category | method | tokens/s (min–max) | speedup (min–max) | mean acc. len | acc. rate | target fwd/token "
        "| draft tok/token |"
    )
    lines.append("|---|---|---|---|---|---|---|---|")
    for cat, methods in table.items():
        for name in shown:
            m = methods.get(name)
            if m is None:
                continue
            t, s = m["tokens_per_s"], m["speedup"]
            lines.append(
                f"| {cat} | {name} | {t['median']:.1f} ({t['min']:.1f}–{t['max']:.1f}) | "
                f"{s['median']:.2f}x ({s['min']:.2f}–{s['max']:.2f}) | {_fmt(m.get('mean_acceptance_length'))} | "
                f"{_fmt(m.get('acceptance_rate'))} | {m['target_forwards_per_token']:.3f} "
                f"| {_fmt(m.get('draft_tokens_per_token'))} |"
            )
    lines += ["", "Projected speedup over the target alone at draft/target cost ratio c (from forward counts):", ""]
    lines.append("| method | " + " | ".join(f"c = {c}" for c in COST_RATIOS) + " |")
    lines.append("|---|" + "---|" * len(COST_RATIOS))
    for name in shown:
        m = table[ALL].get(name)
        if m:
            lines.append(
                f"| {name} | " + " | ".join(f"{m['projected_speedup'][str(c)]:.2f}x" for c in COST_RATIOS) + " |"
            )
    summary = head_summary(table)
    if summary is not None:
        lines += ["", f"Feature draft: best policy {summary['best_head']} {summary['best_head_speedup']:.2f}x vs the "
                  f"small draft's best {summary['best_small_draft']} {summary['best_small_draft_speedup']:.2f}x "
                  f"(ratio {_fmt(summary['head_over_small_draft'])}); SVIP on the head over its best constant depth "
                  f"({summary['best_head_constant']}) {_fmt(summary['head_svip_over_best_constant'])}, over the "
                  f"heuristic {_fmt(summary['head_svip_over_heuristic'])}."]
    lines += hindsight.markdown(learnt or {})
    return "\n".join(lines) + "\n"


def _fmt(x) -> str:
    return "–" if x is None else f"{x:.3f}"


def write_plots(
    out: Path, table: dict, runs: list[Run], thresholds: dict[str, float], entropy_scale: float
) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best = best_constant(table)
    best_hf = f"hf-constant-{best.split('-')[1]}" if best else None
    shown = [
        m
        for m in (
            best,
            "heuristic",
            "confidence",
            "svip",
            "svip-auto",
            "auto",
            "defaults",
            "oracle",
            best_hf,
            "hf-heuristic",
        )
        if m and m in table[ALL]
    ]
    cats = list(table)
    fig, ax = plt.subplots(figsize=(12, 4.5))
    width = 0.8 / max(1, len(shown))
    for i, name in enumerate(shown):
        vals = [table[c].get(name, {}).get("speedup", {}).get("median") or 0 for c in cats]
        ax.bar([x + i * width for x in range(len(cats))], vals, width, label=name)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks([x + width * (len(shown) - 1) / 2 for x in range(len(cats))], cats)
    ax.set_ylabel("speedup over target alone (median)")
    ax.legend(ncol=4, fontsize=8)
    fig.tight_layout()
    files = ["speedup.png"]
    fig.savefig(out / files[0], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    for name in ("svip", best):
        hist = table[ALL].get(name, {}).get("draft_length_histogram", {})
        if hist:
            total = sum(hist.values())
            ax.bar([int(k) for k in hist], [v / total for v in hist.values()], alpha=0.6, label=name)
    ax.set_xlabel("draft length (tokens per block)")
    ax.set_ylabel("share of blocks")
    ax.legend()
    fig.tight_layout()
    files.append("draft_lengths.png")
    fig.savefig(out / files[-1], dpi=110)
    plt.close(fig)

    bands = [b for b in entropy_acceptance(runs) if b["tokens"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    mids = [(b["low"] + min(b["high"], b["low"] + 1.0)) / 2 for b in bands]
    ax.plot(mids, [b["acceptance"] for b in bands], marker="o")
    for label, thr in thresholds.items():
        ax.axvline(
            thr**2 / entropy_scale,
            ls="--",
            color="red" if label == "svip" else "green",
            label=f"{label}: H = {thr**2 / entropy_scale:.2f}",
        )
    ax.set_xlabel("draft entropy H (nats)")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1.05)
    ax.legend()
    fig.tight_layout()
    files.append("entropy_acceptance.png")
    fig.savefig(out / files[-1], dpi=110)
    plt.close(fig)
    return files


def write_all(
    out: Path,
    header: dict,
    table: dict,
    runs: list[Run],
    violations: list[str],
    thresholds: dict[str, float],
    entropy_scale: float,
) -> str:
    out.mkdir(parents=True, exist_ok=True)
    learnt = hindsight.compare(runs)
    md = markdown(table, header, learnt)
    (out / "results.md").write_text(md)
    doc = {
        "header": header,
        "results": table,
        "entropy_acceptance": entropy_acceptance(runs),
        "head_entropy_acceptance": entropy_acceptance(runs, head=True),
        "head_summary": head_summary(table),
        "exactness_violations": violations,
        "best_constant": best_constant(table),
        "learnt_over_best_fixed": learnt,
    }
    (out / "results.json").write_text(json.dumps(doc, indent=1))
    write_plots(out, table, runs, thresholds, entropy_scale)
    return md
