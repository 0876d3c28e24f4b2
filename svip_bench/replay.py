"""`svip bench --mode replay`: every length policy replayed, noise-free, along the target's own greedy
continuations, in modelled time.

Greedy, a block drafted at any place sees the target's tokens before it, so the draft's one
teacher-forced pass over the target's continuation (coordinator/calibration.py's Trajectory) holds
every block any policy could draft there: its tokens' entropies, top probabilities and whether the
target accepts them. The project's own policy objects (draft_worker/policies.py; `auto` with its
live estimate and rate, svip_common/acceptance.py) decide each block's length along it; a round
costs what coordinator/calibration.CostModel says (1 target forward, plus each drafted token's
verification and draft forward, timed on this machine). The oracle drafts exactly the tokens the
target would accept. No wall clock is read while replaying, so two policies differ only by their
lengths: what a wall-clock bench cannot tell apart within its spread, this can. Its limit: the
drafted tokens past a block's first rejection are taken from the teacher-forced pass, not the
draft's own continuation (they change only that block's length, never what it settles)."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from coordinator.calibration import CostModel, Trajectory, measure_costs, record_trajectory
from draft_worker.policies import make_policy
from svip_bench.datasets import Prompt
from svip_bench.hindsight import is_fixed
from svip_bench.methods import Method, build_methods
from svip_common.acceptance import AutoEstimate, SessionStop
from svip_common.auto_prior import estimate_from, stored_prior
from svip_common.auto_settings import AutoSettings
from svip_common.contracts import PolicyConfig, StepState
from svip_common.step_cost import SessionGate, TargetLoad

CAP = 12  # the longest block replayed (the pair's acceptance runs past it rarely)


@dataclass(frozen=True)
class Replayed:
    cost: float  # in one-token target forwards
    emitted: int
    drafted: int

    @property
    def speedup(self) -> float:
        """Tokens per target forward's time: the target alone makes 1."""
        return self.emitted / self.cost if self.cost else 0.0


def replay(traj: Trajectory, policy: PolicyConfig, cost: CostModel, estimate: AutoEstimate | None = None,
           cap: int = CAP, gated: bool = False) -> Replayed:
    """One policy along one trajectory (auto: with the pair's estimate, which its verdicts train).
    gated: behind the load-aware gate (svip_common/step_cost.py) at batch 1, as `svip generate`'s
    defaults run: a paused round is the target's step alone."""
    session = make_policy(policy)
    stop = SessionStop(estimate, True) if policy.name == "auto" else None
    gate = SessionGate(cuts=stop is None) if gated else None
    load = TargetLoad(plain_rate=1.0, verify_token_s=cost.verify_slope)  # time in one-token target forwards
    n, start, total, emitted, drafted_all = len(traj), 0, 0.0, 0, 0
    while start < n:
        if stop is not None:
            session.tune(stop.rule())
        drafted = accepted = 0
        rejected = False
        limit = min(cap, session.max_length(), n - start, gate.cap(load) if gate is not None else cap)
        while drafted < limit:
            i = start + drafted
            drafted += 1
            rejected = rejected or not traj.matches[i]
            accepted += not rejected
            step = StepState(drafted, i, 0, traj.probs[i], traj.entropies[i])
            if session.should_stop(step):
                break
        session.update(drafted, accepted)
        if gate is not None:
            gate.record(drafted, accepted, drafted * cost.draft_ratio)
        if stop is not None and drafted:
            stop.record(traj.entropies[start:start + drafted], traj.probs[start:start + drafted], accepted)
        total += cost.round_cost(drafted)
        emitted += accepted + 1
        drafted_all += drafted
        start += accepted + 1
    return Replayed(total, emitted, drafted_all)


def replay_oracle(traj: Trajectory, cost: CostModel, cap: int = CAP) -> Replayed:
    n, start, total, emitted, drafted_all = len(traj), 0, 0.0, 0, 0
    while start < n:
        accepted = 0
        while start + accepted < n and accepted < cap and traj.matches[start + accepted]:
            accepted += 1
        total += cost.round_cost(accepted)
        emitted += accepted + 1
        drafted_all += accepted
        start += accepted + 1
    return Replayed(total, emitted, drafted_all)


def replayed_methods(ks: list[int], thresholds: tuple[float, ...], confidences: tuple[float, ...],
                     calibrated: float) -> list[Method]:
    """`svip bench`'s own methods (svip_bench/methods.py) but the target alone and the peers."""
    return [m for m in build_methods(ks, 0.3, calibrated, False, thresholds, confidences) if m.family != "target"]


def table(trajs: list[tuple[str, Trajectory]], methods: list[Method], cost: CostModel,
          new_estimate) -> dict[str, dict[str, float]]:
    """category (and "all") -> method -> modelled speedup. Each method replays the prompts in
    order, `auto` (and the defaults) from a fresh estimate (``new_estimate()``), as a new process
    would; a method whose engine runs load-aware replays behind the gate."""
    sums: dict[str, dict[str, list[float]]] = {}
    for method in methods:
        estimate = new_estimate() if method.policy.name == "auto" else None
        for category, traj in trajs:
            if method.family == "oracle":
                r = replay_oracle(traj, cost)
            else:
                r = replay(traj, method.policy, cost, estimate, gated=method.load_aware != "off")
            for cat in (category, "all"):
                cell = sums.setdefault(cat, {}).setdefault(method.name, [0.0, 0.0])
                cell[0] += r.cost
                cell[1] += r.emitted
    return {cat: {name: e / c for name, (c, e) in rows.items()} for cat, rows in sums.items()}


def over_best_fixed(result: dict[str, dict[str, float]]) -> dict[str, dict]:
    out = {}
    for cat, rows in result.items():
        fixed = {m: s for m, s in rows.items() if is_fixed(m)}
        best = max(fixed, key=fixed.get)
        out[cat] = {"best_fixed": best, "best_fixed_speedup": fixed[best], "auto": rows["auto"] / fixed[best],
                    "defaults": rows["defaults"] / fixed[best], "oracle": rows["oracle"] / fixed[best]}
    return out


def run(engine, prompts: list[Prompt], args, header: dict, ks: list[int], thresholds: tuple[float, ...],
        confidences: tuple[float, ...]) -> int:
    target, draft = engine.target, engine.drafter.draft
    tok = target.tokenizer
    trajs = [(p.category, record_trajectory(target, draft, list(tok(p.text)["input_ids"])[-args.max_prompt_tokens:],
                                            args.max_new_tokens)) for p in prompts]
    cost = measure_costs(target, draft)
    calibrated = engine.calibration().threshold
    prior = stored_prior(draft.path)
    tau = cost.draft_ratio + cost.verify_slope

    def new_estimate() -> AutoEstimate:
        # the pair's prior (or the generic one), its tau the one timed here (the live engine times its own)
        return estimate_from(prior, AutoSettings(cost=tau))

    result = table(trajs, replayed_methods(ks, thresholds, confidences, calibrated), cost, new_estimate)
    ratios = over_best_fixed(result)
    header.update(cost={"draft_ratio": cost.draft_ratio, "verify_slope": cost.verify_slope, "tau": tau},
                  prior="stored" if prior else "generic")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "replay.json").write_text(json.dumps({"header": header, "speedup": result, "over_best_fixed": ratios},
                                                indent=1))
    md = markdown(header, result, ratios)
    (out / "replay.md").write_text(md)
    print(md)
    print(f"replay: {len(trajs)} trajectories; wrote {out / 'replay.md'}", file=sys.stderr)
    return 0


def markdown(header: dict, result: dict, ratios: dict) -> str:
    cats = [c for c in result if c != "all"] + ["all"]
    names = list(result["all"])
    lines = [f"Command: `{header['command']}`", f"Machine: {header['machine']}",
             f"Models: target {header['target']}, draft {header['draft']}; {header['prompts']} prompts, "
             f"{header['max_new_tokens']} new tokens, greedy, replayed (no wall clock); round cost 1 + "
             f"{header['cost']['tau']:.3f} per drafted token (draft {header['cost']['draft_ratio']:.3f} + verify "
             f"{header['cost']['verify_slope']:.3f}, timed here); auto from the {header['prior']} prior", "",
             "| method | " + " | ".join(cats) + " |", "|---|" + "---|" * len(cats)]
    for name in names:
        lines.append(f"| {name} | " + " | ".join(f"{result[c].get(name, 0):.3f}x" for c in cats) + " |")
    lines += ["", "| category | best fixed (speedup) | auto over it | defaults over it | oracle over it |",
              "|---|---|---|---|---|"]
    for c in cats:
        r = ratios[c]
        lines.append(f"| {c} | {r['best_fixed']} ({r['best_fixed_speedup']:.3f}x) | {r['auto']:.3f} | "
                     f"{r['defaults']:.3f} | {r['oracle']:.3f} |")
    return "\n".join(lines) + "\n"
