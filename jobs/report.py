"""The end-of-campaign report: ``report.json`` (everything), ``report.md`` (a summary),
``curves.png`` (forget-set and retain accuracy against the number of samples removed) and
``costs.png`` (the cost of each request by stage over the campaign: ``jobs.costs``). Built only
from the ledger (its requests, batches and the batches' recorded costs) and the version
manifests, so a resumed campaign writes the same report."""
from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any

from jobs.costs import EVENT as COSTS_EVENT, STAGES, amortise
from pipeline.checkpoint import atomic_write_bytes
from pipeline.store.ledger import Ledger
from pipeline.store.versions import VersionStore


def campaign_summary(store: VersionStore, ledger: Ledger, campaign_id: str) -> dict[str, Any]:
    """Per batch: state, version, request ids, reason and metrics; totals; the privacy spend."""
    campaign = ledger.get_campaign(campaign_id)
    if campaign is None:
        raise ValueError(f"campaign '{campaign_id}' is not in the ledger {ledger.path}")
    model = campaign.model
    batches = sorted(ledger.batches(origin=f"campaign:{campaign_id}"), key=lambda b: b.index)
    rows, removed = [], 0
    guarantees = {"certified": 0, "heuristic": 0, "none": 0}
    for b in batches:
        metrics: dict[str, Any] | None = None
        if b.state == "applied" and b.version is not None:
            manifest = store.manifest(model, b.version)
            privacy = manifest["privacy"]
            guarantee = privacy.get("guarantee") or privacy["release"].get("guarantee") or "none"
            guarantees[guarantee] = guarantees.get(guarantee, 0) + 1
            metrics = {**manifest["metrics"], "epsilon_total": privacy["spent_after"]["epsilon"],
                       "epsilon": privacy["release"]["epsilon"], "guarantee": guarantee}
            removed += len(b.sample_ids)
        else:
            first = ledger.get_request(b.request_ids[0])
            metrics = first.metrics if first else None
        rows.append({"index": b.index, "batch_key": b.batch_key, "state": b.state, "version": b.version,
                     "parent_version": b.parent_version, "seed": b.seed, "request_ids": b.request_ids,
                     "samples": len(b.sample_ids), "removed_after": removed, "reason": b.reason, "metrics": metrics})
    states = [r.state for r in (ledger.get_request(rid) for rid in ledger.campaign_request_ids(campaign_id)) if r]
    recorded: dict[str, list[dict[str, Any]]] = {}
    for event in ledger.events(model):
        if event["kind"] == COSTS_EVENT and event["key"]:
            recorded.setdefault(event["key"], []).append(event["detail"])
    costs = amortise([{"batch_key": b.batch_key, "request_ids": b.request_ids, "costs": recorded.get(b.batch_key, [])}
                      for b in batches])
    for row, cost in zip(rows, costs["per_batch"]):
        row["costs"] = cost
    return {
        "campaign": campaign_id, "model": model, "spec": campaign.spec,
        "requests": {s: states.count(s) for s in ("accepted", "scheduled", "applied", "failed", "needs_retrain")},
        "total_requests": len(states), "samples_removed": removed, "releases": guarantees,
        "final_version": store.current(model), "batches": rows,
        "costs": {k: v for k, v in costs.items() if k != "per_batch"},
    }


STAGE_COLOURS = {"preparation": "#4c72b0", "load": "#8c8c8c", "removal": "#dd8452", "verification": "#55a868",
                 "publish": "#c44e52", "ledger": "#8172b3", "other": "#dadada"}


def _costs_png(summary: dict[str, Any]) -> bytes:
    """Seconds per request of each batch, stacked by stage (preparation amortised), with the mean
    per request so far."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [b for b in summary["batches"] if (b.get("costs") or {}).get("recorded")]
    fig, ax = plt.subplots(figsize=(8, 4.2), dpi=110)
    if rows:
        xs = [b["index"] for b in rows]
        bottom = [0.0] * len(rows)
        for stage in STAGES:
            heights = [b["costs"]["per_request"][stage] for b in rows]
            ax.bar(xs, heights, bottom=bottom, color=STAGE_COLOURS[stage], label=stage, width=0.8)
            bottom = [a + h for a, h in zip(bottom, heights)]
        weights = [b["costs"]["requests"] for b in rows]
        running, total, count = [], 0.0, 0
        for b, w in zip(rows, weights):
            total += b["costs"]["per_request"]["sum"] * w
            count += w
            running.append(total / count)
        ax.plot(xs, running, "k.-", lw=1, label="mean per request so far")
        ax.legend(fontsize=7, ncol=4, loc="upper right")
        ax.set_ylim(0, max(bottom) * 1.25 if max(bottom) > 0 else 1)
    else:
        ax.text(0.5, 0.5, "no batch costs recorded", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("batch")
    ax.set_ylabel("seconds per request")
    mean = (summary.get("costs") or {}).get("mean_per_request", {}).get("sum")
    ax.set_title(f"campaign {summary['campaign']}: cost per request by stage"
                 + (f" (mean {mean:.3g} s)" if mean is not None else ""))
    ax.grid(axis="y", alpha=0.3)
    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return buffer.getvalue()


def _curves_png(summary: dict[str, Any]) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    applied = [b for b in summary["batches"] if b["state"] == "applied" and b["metrics"]]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    if applied:
        first = applied[0]["metrics"]
        xs = [0] + [b["removed_after"] for b in applied]

        def series(key: str, start_key: str | None) -> list[float]:
            start = first.get(start_key) if start_key else None
            vals = [b["metrics"].get(key) for b in applied]
            return [math.nan if v is None else v for v in [start, *vals]]

        ax.plot(xs, series("cumulative_forget_accuracy", "forget_accuracy_before"), "o-", label="forget set (all removed so far)")
        ax.plot(xs, series("retain_accuracy", "retain_accuracy_before"), "s-", label="retain set")
        ax.plot(xs, series("test_accuracy", "test_accuracy_before"), "^--", label="test set")
    ax.set_xlabel("samples removed")
    ax.set_ylabel("accuracy")
    ax.set_title(f"campaign {summary['campaign']} on {summary['model']}")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    if applied:
        ax.legend(loc="lower left")
    else:
        ax.text(0.5, 0.5, "no batch was applied", ha="center", va="center", transform=ax.transAxes)
    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return buffer.getvalue()


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return "inf" if math.isinf(v) else f"{v:.4f}"
    return str(v)


def _markdown(summary: dict[str, Any]) -> str:
    lines = [
        f"# Campaign `{summary['campaign']}`", "",
        f"Model `{summary['model']}`, final version **{summary['final_version']}**, "
        f"{summary['samples_removed']} samples removed by {summary['requests']['applied']} of "
        f"{summary['total_requests']} requests.", "",
        "| requests | count |", "|---|---|",
        *[f"| {state} | {count} |" for state, count in summary["requests"].items()], "",
        "Privacy releases of the applied batches: " + ", ".join(f"{count} {kind}" for kind, count in summary["releases"].items())
        + " (certified: the bound's conditions hold; heuristic: calibrated noise without the theorem; none: no noise).", "",
        "![accuracy against samples removed](curves.png)", "",
        "| batch | state | version | requests | removed | forget acc. | retain acc. | test acc. | release | epsilon total |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for b in summary["batches"]:
        m = b["metrics"] or {}
        lines.append(f"| {b['index']} | {b['state']} | {_fmt(b['version'])} | {len(b['request_ids'])} | {b['removed_after']} | "
                     f"{_fmt(m.get('cumulative_forget_accuracy'))} | {_fmt(m.get('retain_accuracy'))} | "
                     f"{_fmt(m.get('test_accuracy'))} | {_fmt(m.get('guarantee'))} | {_fmt(m.get('epsilon_total'))} |")
    costs = summary.get("costs") or {}
    mean = costs.get("mean_per_request") or {}
    if mean.get("sum") is not None:
        lines += ["", "## Cost per request", "",
                  f"Mean over {costs['requests_recorded']} requests, seconds (the preparation amortised over the "
                  "requests it served; jobs/costs.py):", "",
                  "| " + " | ".join(STAGES) + " | sum |", "|" + "---|" * (len(STAGES) + 1),
                  "| " + " | ".join(f"{mean[s]:.3f}" for s in STAGES) + f" | {mean['sum']:.3f} |", "",
                  "![cost per request by stage](costs.png)", "",
                  "| batch | requests | " + " | ".join(STAGES) + " | sum |", "|" + "---|" * (len(STAGES) + 3)]
        for b in summary["batches"]:
            c = b.get("costs") or {}
            if c.get("recorded"):
                lines.append(f"| {b['index']} | {c['requests']} | "
                             + " | ".join(f"{c['per_request'][s]:.3f}" for s in STAGES) + f" | {c['per_request']['sum']:.3f} |")
        if costs.get("batches_not_recorded"):
            lines += ["", "Costs not recorded (the process working on them was stopped first): "
                      + ", ".join(costs["batches_not_recorded"])]
    problems = [b for b in summary["batches"] if b["state"] != "applied"]
    if problems:
        lines += ["", "## Batches not applied", ""]
        lines += [f"- batch {b['index']} ({b['state']}), requests {', '.join(b['request_ids'])}: {b['reason']}" for b in problems]
    return "\n".join(lines) + "\n"


def write_report(store: VersionStore, ledger: Ledger, campaign_id: str, out_dir: str | Path) -> Path:
    """Write report.json, report.md, curves.png and costs.png (each atomically); returns the folder."""
    out = Path(out_dir)
    summary = campaign_summary(store, ledger, campaign_id)
    atomic_write_bytes(out / "curves.png", _curves_png(summary))
    atomic_write_bytes(out / "costs.png", _costs_png(summary))
    atomic_write_bytes(out / "report.json", json.dumps(summary, indent=2, sort_keys=True, default=str).encode())
    atomic_write_bytes(out / "report.md", _markdown(summary).encode())
    return out
