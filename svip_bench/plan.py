"""`svip plan`: before buying GPUs, what a pair would make on them, and how to run it.

Given the devices (`--emulate`: the target's GPUs, the draft's, the link), the pair (its weights
here: its acceptance is measured by running it on the sample prompts), a list of policies and of
session counts, it predicts tokens/s and the mean time a request takes at each count n, in waves
of n requests in flight (n distinct sample prompts where there are enough, else the same again, in turn), for:

- the target alone, and in process, the draft on the target's GPUs (the two models taking turns
  on them): the real engine, batched, on a virtual device (svip_common/device_timing.py: each
  forward counted at its step model's time, nothing waited for), its host work measured here
  (times ``--host-scale``: 0 counts the devices alone, as for a host fast enough not to matter);
- distributed sync and async, each model on GPUs of its own: the simulated clock
  (coordinator/simulated.py), the real protocol and models in virtual time.

Then it says which placement, mode and policy make the most tokens/s at each session count, in a
table (plan.md), a JSON document and a plot (plan.png). Every output is checked against the target
alone's (greedy). What it cannot know: how a different pair, with the devices' models' own weights,
would accept (the tokens here are the given pair's), and a real GPU's overheads past its step
model. `svip bench --mode device` checks the simulated clock against device timing here."""

from __future__ import annotations

from itertools import zip_longest
from pathlib import Path

from svip_bench.runner import Progress, full, write_results
from svip_bench.simulate import SplitPairs, in_process_waves
from svip_common.contracts import GenerationRequest, PolicyConfig
from svip_common.emulation import Emulation
from svip_common.errors import InvalidRequest
from svip_common.trees import TREES

PLACEMENTS = ("in process", "sync", "async")
SPLIT = ("sync", "async")  # the placements with each model on GPUs of its own
CONTEXT = 250  # tokens cached before a forward, for the per-token costs the advice quotes
MAX_SESSIONS = 64


def parse_plan_policies(spec: str) -> list[str]:
    names = [p.strip() for p in spec.split(",") if p.strip()]
    bad = next((p for p in names if not _known(p)), None)
    if bad is not None or not names:
        raise InvalidRequest(f"--policies: svip, auto, confidence, heuristic and constant-K (K in 1..16), each "
                             f"optionally +cape, +auto, +deep or +deep-auto (a token tree), got {bad or spec!r}")
    return list(dict.fromkeys(names))


def _known(name: str) -> bool:
    policy, _, tree = name.partition("+")
    if tree and tree not in TREES[1:]:
        return False
    return policy in ("svip", "auto", "confidence", "heuristic") or (
        policy.startswith("constant-") and policy[9:].isdigit() and 1 <= int(policy[9:]) <= 16)


def parse_sessions(spec: str) -> list[int]:
    try:
        counts = sorted({int(v) for v in spec.split(",") if v.strip()})
    except ValueError:
        raise InvalidRequest(f"--sessions: expected comma-separated integers, got {spec!r}") from None
    if not counts or counts[0] < 1 or counts[-1] > MAX_SESSIONS:
        raise InvalidRequest(f"--sessions: session counts must be in [1, {MAX_SESSIONS}]")
    return counts


def policy_config(name: str, threshold: float) -> PolicyConfig:
    """A plan's policy name (svip, constant-3, svip+cape, ...) as the policy it runs."""
    name, _, tree = name.partition("+")
    tree = tree or "off"
    if name == "svip":
        return PolicyConfig(name="svip", threshold=threshold, tree=tree)
    if name.startswith("constant-"):
        return PolicyConfig(name="constant", draft_length=int(name[9:]), tree=tree)
    return PolicyConfig(name=name, tree=tree)


def sample_prompts(categories: str | None, dataset: str | None, per_category: int,
                   largest: int) -> tuple[list, int]:
    """The plan's sample prompts, interleaved by category, and how many of them one session runs
    (per_category of each category): a count of n sessions runs the first max(n, that many), so
    each wave holds distinct prompts where there are enough (a prompt repeated in a wave runs in
    lockstep with its copies: 70B@4xH100 / 1B@H100 at 32 sessions, async svip made 0.82x the
    in-process pair on 4 code prompts repeated, 0.99x on 32 distinct ones)."""
    from svip_bench.command import prompts_for

    groups: dict[str, list] = {}
    for prompt in prompts_for(categories, dataset, max(per_category, largest)):
        groups.setdefault(prompt.category, []).append(prompt)
    interleaved = [p for row in zip_longest(*groups.values()) for p in row if p is not None]
    few = min(len(interleaved), per_category * len(groups))
    return interleaved[:max(few, largest)], few


def run(engine, encoded_prompts: list, emulation: Emulation, policies: list[str], sessions: list[int],
        max_new_tokens: int, header: dict, out: Path, host_scale: float = 1.0, few: int | None = None) -> int:
    """host_scale: this machine's host work, times this, counts in every row (0: the devices alone);
    few: the prompts one session runs (sample_prompts; None: all), n sessions the first max(n, few)."""
    threshold = engine.calibration().threshold
    few = len(encoded_prompts) if few is None else few

    def requests(policy: PolicyConfig, n: int) -> list[GenerationRequest]:
        """Full waves of n (the prompts again, in turn, where there are fewer)."""
        return full([GenerationRequest(ids, max_new_tokens, ignore_eos=True, policy=policy)
                     for ids in encoded_prompts[:max(n, few)]], n)

    none = PolicyConfig(name="none")
    alone = [engine.generate(GenerationRequest(ids, max_new_tokens, ignore_eos=True, policy=none)).token_ids
             for ids in encoded_prompts]  # each prompt's own output, which every row must equal
    together = emulation.co_located()
    header.update(emulate=emulation.spec, emulated=emulation.describe(), in_process=together.describe(),
                  svip_threshold=threshold, policies=policies, sessions=sessions,
                  target_tp=emulation.target.count,  # the step model's N devices: N tensor-parallel ranks
                  costs_ms={"target forward": 1e3 * emulation.target.forward_s([(1, CONTEXT)]),
                            "draft token, own devices": 1e3 * emulation.draft.forward_s([(1, CONTEXT)]),
                            "draft token, in process": 1e3 * together.draft.forward_s([(1, CONTEXT)])})
    progress = Progress(len(sessions) * (1 + len(policies) * len(PLACEMENTS)))
    pairs = SplitPairs(engine, emulation, host_scale)  # kept from row to row, as the engine is
    rows, violations = [], []

    def add(n, placement, policy, measured):
        (tps, mean_s), outputs = measured
        rows.append({"sessions": n, "placement": placement, "policy": policy, "tokens_per_s": tps,
                     "mean_request_s": mean_s})
        violations.extend(f"{n} {placement} {policy}: prompt {i}" for i, (a, b) in
                          enumerate(zip(outputs, full(alone[:max(n, few)], n))) if a != b)
        progress.update(1)

    for n in sessions:
        add(n, "target alone", "none", _in_process(engine, emulation, requests(PolicyConfig(name="none"), n), n,
                                                   host_scale))
        for name in policies:
            drafting = requests(policy_config(name, threshold), n)
            add(n, "in process", name, _in_process(engine, emulation, drafting, n, host_scale))
            for mode in ("sync", "async"):  # a token tree too: greedy trees cross the workers
                waves = pairs.waves(drafting, n, mode)
                add(n, mode, name, ((waves.tokens_per_s, waves.mean_request_s), waves.outputs))
    doc = {"header": header, "rows": rows, "advice": advice(rows), "exactness_violations": violations}
    status = write_results(out, "plan", doc, report(doc))
    _plot(out / "plan.png", rows, sessions)
    return status


def _in_process(engine, emulation: Emulation, requests, n: int,
                host_scale: float = 1.0) -> tuple[tuple[float, float], list]:
    """The engine batched n at a time on a virtual device the two models share
    (simulate.in_process_waves: load-aware off, as the split rows run): tokens/s and the mean
    request's time, in the device's time plus the host work measured here times host_scale."""
    waves = in_process_waves(engine, emulation, requests, n, host_scale)
    return (waves.tokens_per_s, waves.mean_request_s), waves.outputs


def advice(rows: list[dict]) -> dict:
    """At each session count: the row that makes the most tokens/s, and its ratio to the target alone;
    where that is not a split placement, the best split one (``split``) and its ratio to it."""
    out = {}
    for n in sorted({r["sessions"] for r in rows}):
        at = [r for r in rows if r["sessions"] == n]
        alone = next(r for r in at if r["placement"] == "target alone")
        best = max(at, key=lambda r: r["tokens_per_s"])
        out[str(n)] = {"placement": best["placement"], "policy": best["policy"],
                       "tokens_per_s": best["tokens_per_s"], "over_alone": best["tokens_per_s"] / alone["tokens_per_s"]}
        split = max((r for r in at if r["placement"] in SPLIT), key=lambda r: r["tokens_per_s"], default=None)
        if split is not None and best["placement"] not in SPLIT:
            out[str(n)]["split"] = {"placement": split["placement"], "policy": split["policy"],
                                    "tokens_per_s": split["tokens_per_s"],
                                    "over_best": split["tokens_per_s"] / best["tokens_per_s"]}
    return out


def report(doc: dict) -> str:
    h, rows = doc["header"], doc["rows"]
    lines = [
        f"Command: `{h['command']}`",
        f"Machine: {h['machine']} ({_host_work(h)}; forwards at their step models' time)",
        f"Devices: {h['emulated']}; in process: {h['in_process']} (the models taking turns on the target's "
        f"devices). The tokens of {h['target']} and {h['draft']}: {h['prompts']} prompts{_at_load(h)}, "
        f"{h['max_new_tokens']} new tokens, greedy; svip at {h['svip_threshold']:.2f} (the pair's calibration), "
        "load-aware off.",
        "",
        "| sessions | placement | policy | tokens/s | vs the target alone | mean request, s |",
        "|---|---|---|---|---|---|",
    ]
    for n in sorted({r["sessions"] for r in rows}):
        at = [r for r in rows if r["sessions"] == n]
        alone = next(r for r in at if r["placement"] == "target alone")["tokens_per_s"]
        for r in sorted(at, key=lambda r: -r["tokens_per_s"]):
            lines.append(f"| {n} | {r['placement']} | {r['policy']} | {r['tokens_per_s']:.1f} | "
                         f"{r['tokens_per_s'] / alone:.2f}x | {r['mean_request_s']:.3f} |")
    ranks = h.get("target_tp", 1)
    runs = (f" The target runs as {ranks} tensor-parallel ranks, a GPU each (svip generate / serve / bench "
            f"--target-tp {ranks}; the chart's model.tensorParallel), as timed here.") if ranks > 1 else ""
    lines += ["", "Advice:" + runs]
    for n, a in doc["advice"].items():
        how = "the target alone" if a["placement"] == "target alone" else \
            f"{a['placement']}{'' if a['placement'] == 'in process' else ' (distributed)'}, policy {a['policy']}"
        lines.append(f"- {n} session{'s' if n != '1' else ''} in flight: {how}: {a['tokens_per_s']:.1f} tokens/s, "
                     f"{a['over_alone']:.2f}x the target alone{_why_not_split(a.get('split'), h)}")
    return "\n".join(lines)


def _at_load(header: dict) -> str:
    """How many prompts the larger counts' waves hold (sample_prompts)."""
    more = header.get("prompts_at_load", header["prompts"])
    if more <= header["prompts"]:
        return ""
    return f" (n sessions run the first max(n, {header['prompts']}) of {more}, distinct in each wave)"


def _host_work(header: dict) -> str:
    """What the rows count past the devices' time: this machine's host work (times --host-scale), or none."""
    scale = header.get("host_scale", 1.0)
    if not scale:
        return "host work not counted (--host-scale 0: the devices alone)"
    return "the host work measured here" + ("" if scale == 1 else f", times {scale:g},") + " counts in every row"


def _why_not_split(split: dict | None, header: dict) -> str:
    """Where a split placement does not lead: the best one, and what its draft and the target cost."""
    if split is None:
        return ""
    costs = header.get("costs_ms")
    why = "" if not costs else (
        f": its draft takes {costs['draft token, own devices']:.2f} ms a token on its own devices, "
        f"{costs['draft token, in process']:.2f} ms on the target's, against {costs['target forward']:.2f} ms a "
        f"target forward; {_host_work(header)}")
    return (f". The split pipeline at best ({split['placement']}, {split['policy']}): {split['tokens_per_s']:.1f} "
            f"tokens/s, {split['over_best']:.2f}x that{why}")


def _plot(path: Path, rows: list[dict], sessions: list[int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    series = sorted({(r["placement"], r["policy"]) for r in rows})
    for placement, policy in series:
        points = sorted((r["sessions"], r["tokens_per_s"]) for r in rows
                        if (r["placement"], r["policy"]) == (placement, policy))
        label = placement if placement == "target alone" else f"{placement}, {policy}"
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label,
                linestyle="--" if placement == "target alone" else "-")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sessions, [str(n) for n in sessions])
    ax.set_xlabel("sessions in flight")
    ax.set_ylabel("tokens/s (predicted)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
