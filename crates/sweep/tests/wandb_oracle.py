"""W&B's own sweep engine (the `sweeps` package on PyPI, what W&B's controller runs) as the
oracle for oomguard's reading of W&B sweep files; src/wandb_oracle.rs calls it.

One request as JSON on stdin, one answer as JSON on stdout:
  {"op": "violations", "configs": [...]} -> W&B's schema violations of each (lists of strings)
  {"op": "grid", "config": {...}}         -> next_run iterated to the end: each run's
                                             parameters, nested ones under dotted keys
  {"op": "support", "config": {...}, "draws": [{key: value}]}
                                          -> the draws outside W&B's support (a list of
                                             strings), after W&B's bayes engine read them
  {"op": "stop", "queries": [{"config": {...}, "runs": [{"name", "state", "history"}]}]}
                                          -> per query, the names stop_runs stops
  {"op": "sequential", "sweeps": [{"config": {...}, "curves": [[loss per step]]}]}
                                          -> per sweep, W&B's own sweep with one agent on
                                             these curves: the steps each run trained
                                             before stop_runs stopped it (checked every step)
"""

import json
import math
import sys
import warnings

warnings.filterwarnings("ignore")

import sweeps  # noqa: E402
from sweeps.params import HyperParameter, HyperParameterSet  # noqa: E402
from sweeps.run import RunState, SweepRun  # noqa: E402

DELIM = HyperParameterSet.NESTING_DELIMITER


def flat_params(config, run_config):
    params = HyperParameterSet.from_config(config["parameters"])
    return {p.name.replace(DELIM, "."): params._get_val_from_config(run_config, p.name) for p in params}


def grid(config):
    runs, out = [], []
    while True:
        # validate=False: SweepConfig's filled defaults lose nested parameters' values (the
        # schema is checked by "violations").
        run = sweeps.next_run(config, runs)
        if run is None:
            return out
        run.state = RunState.finished
        runs.append(run)
        out.append(flat_params(config, run.config))


def multiple(v, q):
    return abs(v / q - round(v / q)) < 1e-6


def outside(hp, v):
    """Why `v` is outside `hp`'s support, or None."""
    c, t = hp.config, hp.type
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        if t not in (HyperParameter.CONSTANT, HyperParameter.CATEGORICAL, HyperParameter.CATEGORICAL_PROB):
            return f"{v!r} is not a number"
    if t == HyperParameter.CONSTANT:
        return None if v == c["value"] else f"{v!r} is not the constant {c['value']!r}"
    if t == HyperParameter.CATEGORICAL_PROB:
        return None if any(v == x and type(v) is type(x) for x in c["values"]) else f"{v!r} is not one of {c['values']}"
    if t == HyperParameter.CATEGORICAL:
        try:
            hp.value_to_idx(v)
            return None
        except Exception as e:  # W&B's own refusal
            return f"{v!r}: {e}"
    if not math.isfinite(v):
        return f"{v!r} is not finite"
    q = c.get("q")
    if q is not None:
        if not multiple(v, q):
            return f"{v!r} is not a multiple of q {q}"
        if isinstance(q, int) and not isinstance(v, int):
            return f"{v!r} is not an integer (q {q} is one)"
    lo, hi = c.get("min"), c.get("max")
    slack = (q or 0) / 2 + 1e-9 * max(1.0, abs(hi or 0))
    if t == HyperParameter.INT_UNIFORM:
        return None if isinstance(v, int) and lo <= v <= hi else f"{v!r} is not an integer in [{lo}, {hi}]"
    if t in (HyperParameter.UNIFORM, HyperParameter.Q_UNIFORM, HyperParameter.LOG_UNIFORM_V2, HyperParameter.Q_LOG_UNIFORM_V2):
        return None if lo - slack <= v <= hi + slack else f"{v!r} is outside [{lo}, {hi}]"
    if t in (HyperParameter.LOG_NORMAL,):
        return None if v > 0 else f"{v!r} is not above 0"
    if t in (HyperParameter.Q_LOG_NORMAL,):
        return None if v >= 0 else f"{v!r} is below 0"
    if t in (HyperParameter.NORMAL, HyperParameter.Q_NORMAL):
        return None
    return f"distribution {t} has no support check here"


def support(config, draws):
    params = HyperParameterSet.from_config(config["parameters"])
    bad = []
    for i, d in enumerate(draws):
        for p in params:
            key = p.name.replace(DELIM, ".")
            why = outside(p, d.get(key))
            if why:
                bad.append(f"draw {i} {key}: {why}")
            elif p.type != HyperParameter.CONSTANT:
                x = float(p.cdf(d[key])) if p.type not in (HyperParameter.CATEGORICAL, HyperParameter.CATEGORICAL_PROB) else 0.5
                if not 0.0 <= x <= 1.0:
                    bad.append(f"draw {i} {key}: W&B's cdf is {x}")
    # W&B's bayes engine reads the draws as finished runs (its cdf of each value) and proposes.
    metric = config.get("metric", {}).get("name", "loss")
    runs = [
        SweepRun(name=f"r{i}", state=RunState.finished, config={k: {"value": v} for k, v in d.items()}, summary_metrics={metric: float(i % 7)})
        for i, d in enumerate(draws)
    ]
    nested = {k.replace(".", DELIM): v for k, v in draws[0].items()} if draws else {}
    if not any(DELIM in k for k in nested):
        bayes = dict(config, method="bayes", metric={"name": metric, "goal": "minimize"})
        bayes.pop("run_cap", None)
        sweeps.next_run(bayes, runs, validate=True)
    return bad[:10]


def stop(queries):
    out = []
    for q in queries:
        runs = [SweepRun(name=r["name"], state=RunState(r["state"]), history=r["history"]) for r in q["runs"]]
        out.append(sorted(r.name for r in sweeps.stop_runs(q["config"], runs, validate=True)))
    return out


def sequential(config, curves):
    done, reached = [], []
    for i, curve in enumerate(curves):
        name = f"{i:03}-x"
        upto = len(curve)
        for step in range(1, len(curve) + 1):
            run = SweepRun(name=name, state=RunState.running, history=[{"loss": v} for v in curve[:step]])
            if any(r.name == name for r in sweeps.stop_runs(config, done + [run])):
                upto = step
                break
        done.append(SweepRun(name=name, state=RunState.finished, history=[{"loss": v} for v in curve[:upto]]))
        reached.append(upto)
    return reached


def main():
    req = json.load(sys.stdin)
    op = req["op"]
    if op == "violations":
        ans = [sweeps.schema_violations_from_proposed_config(c) for c in req["configs"]]
    elif op == "grid":
        ans = grid(req["config"])
    elif op == "support":
        ans = support(req["config"], req["draws"])
    elif op == "stop":
        ans = stop(req["queries"])
    elif op == "sequential":
        ans = [sequential(s["config"], s["curves"]) for s in req["sweeps"]]
    else:
        raise SystemExit(f"unknown op {op}")
    json.dump({"version": sweeps.__version__, "answer": ans}, sys.stdout)


if __name__ == "__main__":
    main()
