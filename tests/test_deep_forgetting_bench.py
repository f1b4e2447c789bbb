"""bench.deep_forgetting (issue 26: forgetting inside networks trained end to end) at its --smoke size, on
each of its three benchmarks (Fashion-MNIST CNN, R8 text classifier with its last two layers fine-tuned (a
tiny random BERT with MiniLM's tokenizer stands for MiniLM in the smoke profile), synthetic identities on the
re-ID ResNet): every table has its shape; every registered method that applies has a row, a refusal or an
error; the tuning sets are declared and disjoint from the reported ones; the "cannot discriminate" mark
follows its rule; the KL unit and the forgotten identity's retrieval metrics against hand-made cases; and
every new model config trains with `unlearn train` at a tiny size."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

# the smoke profile of the image benchmarks (r8-minilm's encoder passes cost most of a minute on CPU: its
# table comes from the benchmark run itself)
DATASETS = ("fmnist-cnn", "identities")


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    from bench import deep_forgetting

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {name: deep_forgetting.run(name, profile="smoke") for name in DATASETS}
    finally:
        torch.set_num_threads(threads)


def test_tables_have_their_shape(results: dict[str, dict], tmp_path: Path) -> None:
    from bench.deep_forgetting import COLUMNS, DATASETS as SPECS, HEADERS, RETRIEVAL_COLUMNS, render_markdown, write_outputs

    for name, result in results.items():
        assert list(result["scenarios"]) == list(SPECS[name].scenarios)
        json.loads(json.dumps(result, allow_nan=False))  # strict JSON
        paths = write_outputs(result, f"deep_{name}_smoke", tmp_path)
        table = paths["md"].read_text()
        assert table == render_markdown(json.loads(paths["json"].read_text()))
        expected_rows = ["original", "retrain", "retrain-reseed", *result["rows"]]
        for scenario, block in result["scenarios"].items():
            assert list(block["summary"]) == expected_rows, (name, scenario)
            embedding = name == "identities" and scenario in ("identity", "subject")
            cols = [*COLUMNS[:7], *(RETRIEVAL_COLUMNS if embedding else ()), *COLUMNS[7:]]
            header = "| row | " + " | ".join(HEADERS.get(c, c) for c in cols) + " |"
            section = table.split(f"**{scenario}**", 1)[1].split("\n**", 1)[0]
            assert header in section, (name, scenario)
            rows_part = section.split("U-LiRA reads", 1)[0]  # the table (the attack's reads follow in U-LiRA cells)
            lines = [line for line in rows_part.splitlines() if line.startswith("| ") and not line.startswith("| row")]
            assert [line.split(" | ")[0][2:].rstrip(" *") for line in lines] == expected_rows
            assert all(line.count("|") == len(cols) + 2 for line in lines), (name, scenario)
            for col in ("UA", "RA", "TA", "MIA", "AvgGap", "KL_forget", "KL_test"):
                assert col in block["summary"]["retrain"], (name, scenario, col)
            assert block["summary"]["retrain"]["AvgGap"]["mean"] == 0.0
            for run in block["runs"]:  # MIA is the mean of its draws, each kept (as many as the profile's repeats)
                for row in (r for r in run["rows"].values() if "MIA" in r):
                    assert len(row["MIA_draws"]) == result["profile_settings"]["mia"][1]
                    assert row["MIA"] == pytest.approx(float(np.mean(row["MIA_draws"])), abs=1e-3)
            assert block["summary"]["retrain"]["KL_forget"]["mean"] == 0.0
            assert block["summary"]["retrain-reseed"]["KL_forget"]["mean"] == pytest.approx(1.0)
            if embedding:
                for col in RETRIEVAL_COLUMNS:
                    assert col in block["summary"]["retrain"], (scenario, col)
        cells = [block.get("ulira") for sc, block in result["scenarios"].items() if sc in result["ulira_cells"]]
        assert len(cells) == 2 and all(c and c["shadows"] == result["shadows"] for c in cells)
        for cell in cells:
            original = cell["rows"]["original"]
            assert 0 <= original["accuracy"] <= 100 and original["ci95"][0] <= original["accuracy"] <= original["ci95"][1]
            for row, game in cell["rows"].items():  # what the attack reads: phi's shift = its parts' difference
                if "accuracy" not in game:
                    continue
                reads = game["reads"]
                assert reads["phi"]["shift"] == pytest.approx(reads["label"]["shift"] - reads["others"]["shift"], abs=1e-9)
                assert reads["phi"]["std_retrained"] > 0, (name, row)
        sections = [table.split(f"**{sc}**", 1)[1].split("\n**", 1)[0] for sc in result["ulira_cells"]]
        assert all("U-LiRA reads" in section and "| original | " in section.split("U-LiRA reads", 1)[1]
                   for section in sections), name


def test_run_all_runs_and_summarises_the_deep_benchmark(results: dict[str, dict], tmp_path: Path) -> None:
    """``python -m bench.run_all`` has an entry per data set of this benchmark in every mode (its command: this
    module with the data set and the mode's flag), and its summary renders each result as this module's compact
    table (not the generic key / value dump)."""
    import importlib

    from bench.deep_forgetting import DATASETS as SPECS, render_summary, write_outputs
    from bench.run_all import BENCHMARKS, kind_of, write_summary

    for name in SPECS:
        entry = BENCHMARKS[f"deep_{name}"]
        assert entry["module"] == "deep_forgetting" and entry["quick"][:3] == ["--dataset", name, "--quick"]
        assert entry["smoke"][:3] == ["--dataset", name, "--smoke"] and entry["default"][:2] == ["--dataset", name]
    for key, entry in BENCHMARKS.items():  # every entry names a module of bench/ with a main
        module = importlib.import_module(f"bench.{entry.get('module') or 'bench_' + key}")
        assert callable(module.main), key
    for name, result in results.items():
        write_outputs(result, f"deep_{name}_smoke", tmp_path)
        assert kind_of(tmp_path / f"deep_{name}_smoke.json", result) == "deep"
    text = write_summary(tmp_path, tmp_path / "summary.md", include_smoke=True).read_text()
    for name, result in results.items():
        section = text.split(f"## deep_{name}_smoke", 1)[1].split("\n## ", 1)[0]
        assert render_summary(result).splitlines()[0] in section and "could not summarise" not in section


def test_every_applicable_method_has_a_row_a_refusal_or_an_error(results: dict[str, dict]) -> None:
    from bench.deep_forgetting import SMOKE_ROWS, registered_rows

    rows = registered_rows()
    assert {"block-gauss-newton", "lfoci-newton", "finetune", "gradient-ascent", "random-labels", "salun"} <= set(rows)
    for name, result in results.items():
        assert set(result["rows"]) | set(result["skipped_rows"]) == set(rows), name
        assert set(result["rows"]) == set(SMOKE_ROWS) - set(result["skipped_rows"]), name  # the profile's rows
        assert "block-gauss-newton" in result["rows"], name  # our method for deep networks has a row everywhere
        assert not set(result["rows"]) & set(result["skipped_rows"])
        assert all(why.strip() for why in result["skipped_rows"].values())
        assert "mixed-linear" in result["skipped_rows"]
        for scenario, block in result["scenarios"].items():
            for run in block["runs"]:
                for row in result["rows"]:
                    cell = run["rows"][row]
                    assert ("UA" in cell) + ("needs_retrain" in cell) + ("error" in cell) == 1, (name, scenario, row)
                    assert cell["cold_seconds"] >= 0 and cell["served"] == ("UA" in cell)
            for row in result["rows"]:
                assert row in block["campaign"]["rows"], (name, scenario, row)
                assert "served" in block["summary"][row]
            for row in result["rows"]:
                for key in (f"{row}/{scenario}",):
                    assert key in result["chosen_settings"], key


def test_tuning_sets_are_declared_and_disjoint_from_the_reported_ones(results: dict[str, dict]) -> None:
    for name, result in results.items():
        for scenario, declared in result["declared_sets"].items():
            assert declared["tuning"], (name, scenario)
            reported = {i for fs in declared["reported"] for i in fs["sample_ids"]}
            for fs in declared["tuning"]:
                assert not reported & set(fs["sample_ids"]), (name, scenario)
                if fs["label"] is not None:
                    assert fs["label"] not in {r["label"] for r in declared["reported"]}, (name, scenario)
            tuned = result["tuning"]["scenarios"][scenario]

            def same(a: dict, b: dict) -> bool:
                return (a["m"], a["label"], a["index"], a["role"]) == (b["m"], b["label"], b["index"], b["role"]) and \
                    b["sample_ids"][:20] == (a.get("sample_ids") or a.get("first_sample_ids"))[:20]

            assert all(same(a, b) for a, b in zip(tuned["sets"], declared["tuning"], strict=True))
            used = [r["set"] for r in result["scenarios"][scenario]["runs"]]
            assert all(same(a, b) for a, b in zip(used, declared["reported"], strict=True))
            retrains = result["profile_settings"]["tuning_retrains"]
            assert retrains >= 2   # the smoke profile measures the tie rule's reference over two Retrain seeds
            for ref in tuned["references"]:
                per_seed = ref["phi_retrain"]["mean_phi_per_seed"]
                assert ref["phi_retrain"]["seeds"] == list(range(retrains)) and len(per_seed) == retrains
                assert all(math.isfinite(v) for v in per_seed) and len(set(per_seed)) == retrains, per_seed
            for row, entry in tuned["rows"].items():
                assert entry["chosen"] == result["chosen_settings"][f"{row}/{scenario}"]
                assert len(entry["points"]) == result["tuning"]["grid_used"]


def test_forget_sets_at_full_size_are_disjoint_too() -> None:
    from bench.deep_forgetting import draw_forget_sets
    from pipeline.data import SampleSet

    y = torch.arange(10).repeat_interleave(300)
    train = SampleSet({"x": torch.zeros(len(y), 1), "y": y}, torch.arange(len(y)) * 3 + 7)
    for scenario in ("random_1pct", "random_10pct", "class", "subject"):
        reported, tuning = draw_forget_sets(scenario, train, 10, 3, 1)
        assert len(reported) == 3 and len(tuning) == 1
        ids = [set(fs.ids) for fs in reported + tuning]
        assert all(not (a & b) for i, a in enumerate(ids) for b in ids[i + 1:]), scenario
        if scenario != "subject":
            assert len({len(s) for s in ids}) == 1
        else:
            assert all(5 <= len(s) <= 20 for s in ids)
        if scenario in ("class", "subject"):
            assert len({fs.label for fs in reported + tuning}) == 4


def test_cannot_discriminate_follows_its_rule(results: dict[str, dict]) -> None:
    from bench.deep_forgetting import cannot_discriminate

    assert cannot_discriminate(1.0, 0.1) and cannot_discriminate(0.3, 0.0)
    assert not cannot_discriminate(1.5, 0.5)          # max(1, 2 x 0.5) = 1 < 1.5
    assert cannot_discriminate(3.9, 2.0) and not cannot_discriminate(4.1, 2.0)  # max(1, 4) = 4
    for result in results.values():
        for scenario, block in result["scenarios"].items():
            original = block["summary"]["original"]["AvgGap"]["mean"]
            reseed = block["summary"]["retrain-reseed"]["AvgGap"]["mean"]
            assert block["cannot_discriminate"] == (original <= max(1.0, 2 * reseed)), scenario


def test_kl_in_retrain_reseed_units_on_a_hand_made_case() -> None:
    from bench.deep_forgetting import add_gaps, kl_units
    from pipeline.evaluate.divergence import function_space_gap

    retrain = torch.log(torch.tensor([[0.75, 0.25], [0.5, 0.5]]))
    model = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.5]]))
    reseed = torch.log(torch.tensor([[0.25, 0.75], [0.5, 0.5]]))
    kl_model = 0.5 * (0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25))  # second row: 0
    kl_reseed = 0.5 * (0.25 * math.log(0.25 / 0.75) + 0.75 * math.log(0.75 / 0.25))
    got = function_space_gap(model, retrain, reseed)
    assert got["kl"] == pytest.approx(kl_model) and got["unit"] == pytest.approx(kl_reseed)
    assert got["units"] == pytest.approx(kl_model / kl_reseed)
    assert kl_units(0.3, 0.0) is None and function_space_gap(model, retrain, retrain)["units"] is None
    # the harness's own gaps: the same numbers, Retrain 0 and retrain-reseed 1 unit
    base = {"UA": 0.0, "RA": 100.0, "TA": 90.0, "MIA": 10.0}
    rows = {name: {**base, "_logits": {"forget": z, "test": z}} for name, z in
            (("retrain", retrain), ("retrain-reseed", reseed), ("m", model))}
    add_gaps(rows)
    assert rows["m"]["KL_forget"] == pytest.approx(kl_model / kl_reseed) and rows["m"]["KL_test_nats"] == pytest.approx(kl_model)
    assert rows["retrain"]["KL_forget"] == 0.0 and rows["retrain-reseed"]["KL_test"] == pytest.approx(1.0)


def test_retrieval_of_a_forgotten_identity_on_a_hand_made_embedding() -> None:
    from pipeline.evaluate.retrieval import identity_retrieval, membership_gap, verification_scores

    e = torch.eye(3, dtype=torch.float64)
    # identity 0: images a, b near e0 and c near e1 (where identity 1 lives); identity 1: two images at e1
    a, b = e[0], torch.nn.functional.normalize(e[0] + 0.1 * e[2], dim=0)
    c = torch.nn.functional.normalize(e[1] + 0.05 * e[0], dim=0)
    feats = torch.stack([a, b, c, e[1], torch.nn.functional.normalize(e[1] + 0.01 * e[2], dim=0)])
    labels = torch.tensor([0, 0, 0, 1, 1])
    got = identity_retrieval(feats, labels, 0)
    # queries a, b: the other of the pair first, then c (slightly towards e0) before identity 1: AP 1;
    # query c: identity 1's two images first, then a and b at ranks 3 and 4: AP (1/3 + 2/4) / 2, rank-1 missed
    ap_ab = 1.0
    ap_c = (1.0 / 3.0 + 2.0 / 4.0) / 2.0
    assert got["queries"] == 3
    assert got["rank1"] == pytest.approx(100.0 * 2 / 3)
    assert got["mAP"] == pytest.approx(100.0 * (2 * ap_ab + ap_c) / 3)
    ver = verification_scores(feats, labels, 0, far=0.0)
    cos = feats @ feats.T
    genuine = [cos[0, 1], cos[0, 2], cos[1, 2]]
    assert ver["genuine_cos"] == pytest.approx(float(np.mean(genuine)))
    impostor_max = max(float(cos[i, j]) for i in range(3) for j in (3, 4))
    assert ver["threshold"] == pytest.approx(impostor_max)  # FAR 0: above every impostor pair
    assert ver["TAR"] == pytest.approx(100.0 * sum(float(g) >= impostor_max for g in genuine) / 3)
    # membership gap: training images on the held-out centre vs the held-out images themselves
    to_centre = float(torch.nn.functional.cosine_similarity(feats[:2], feats[:2].mean(0, keepdim=True)).mean())
    assert membership_gap(feats[:2], feats[:2]) == pytest.approx(to_centre - float(cos[0, 1]))
    assert membership_gap(feats[:1], feats[1:2]) != membership_gap(feats[:1], feats[1:2])  # one held-out image: NaN


@pytest.mark.parametrize("config, tiny", [
    ("cnn-fmnist", {"data": {"per_class": 4, "test_per_class": 2}, "model": {}}),
    ("reid-identities", {"data": {"ids": 4, "per_id_train": 3, "per_id_test": 2, "height": 16, "width": 8},
                         "model": {"num_classes": 4, "image_size": 16}}),
    ("minilm2-r8", {"data": {"per_class": 2, "test_per_class": 1, "max_length": 8}, "model": {}}),
])
def test_each_new_model_config_trains_with_unlearn_train(config: str, tiny: dict, tmp_path: Path) -> None:
    import yaml
    from click.testing import CliRunner

    from jobs.train import command
    from pipeline.models.card import read_card

    root = Path(__file__).resolve().parents[1]
    raw = yaml.safe_load((root / "configs" / "models" / f"{config}.yaml").read_text())
    raw["data"]["options"].update(tiny["data"])
    raw["model"]["options"].update(tiny["model"])
    raw["recipe"].update({"epochs": 1, "report_samples": 4})
    path = tmp_path / f"{config}.yaml"
    path.write_text(yaml.safe_dump(raw))
    out = tmp_path / "model"
    result = CliRunner().invoke(command, [str(path), "--output", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output[result.output.index("{"):])
    assert summary["trainable_parameters"] > 0 and math.isfinite(summary["final_objective"])
    card = read_card(out)
    assert card.preset == raw["model"]["preset"] and card.training.extra["fit"]["report_samples"] == 4
    assert "unlearn train configs/models/" + config + ".yaml" in (root / "configs" / "models" / f"{config}.yaml").read_text()


def test_a_partial_run_records_its_overrides_and_writes_apart(tmp_path: Path) -> None:
    """--scenarios / --sets / --shadows / --campaign / --methods: the profile's entries replaced, recorded with
    the command, and written to *_partial*.json (never over the profile's own file)."""
    from bench import deep_forgetting

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        argv = ["--dataset", "fmnist-cnn", "--smoke", "--scenarios", "subject", "--sets", "1", "--shadows", "0",
                "--campaign", "0", "--methods", "lfoci-newton", "--out-dir", str(tmp_path)]
        assert deep_forgetting.main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == ["deep_fmnist-cnn_smoke_partial_subject.json", "deep_fmnist-cnn_smoke_partial_subject.md"]
    result = json.loads((tmp_path / written[0]).read_text())
    assert result["overrides"] == {"sets": 1, "shadows": 0, "campaign": 0}
    block = result["scenarios"]["subject"]  # no campaign: no per-request figure (not a ratio over zero requests)
    assert block["campaign"] is None and "request_x" not in block["summary"]["lfoci-newton"]
    assert result["profile_settings"]["shadows"] == 0 and result["scenarios_run"] == ["subject"]
    assert list(result["scenarios"]) == ["subject"] and result["command"][3:] == argv
    assert set(result["rows"]) == {"lfoci-newton"}
    assert result["scenarios"]["subject"]["ulira"] is None


@pytest.mark.parametrize("scope", ["scenario", "run"])
def test_a_timed_out_row_is_not_tried_again_within_its_scope(scope: str) -> None:
    """After a removal ran past the row time limit: by default the same row and settings are skipped on that
    scenario (and everywhere after a timed-out preparation) unless a later limit is larger; under timeout_scope
    "run" (the quick profile's budget) the row is skipped everywhere, at any settings and limit."""
    from bench.deep_forgetting import RowTimeout, setup

    ctx = setup("fmnist-cnn", "smoke", overrides={"timeout_scope": scope})
    assert ctx.timed_out_before("lfoci-newton", "{}", "class", 24.0) is None
    ctx.note_timeout("lfoci-newton", "{}", "random_1pct", "removal", RowTimeout("stopped after 24 s"), 24.0)
    assert "stopped after 24 s" in ctx.timed_out_before("lfoci-newton", "{}", "random_1pct", 24.0)
    assert ctx.timed_out_before("trajectory-refit", "{}", "random_1pct", 24.0) is None  # another row runs
    later = [ctx.timed_out_before("lfoci-newton", "{}", "class", 24.0),            # another scenario
             ctx.timed_out_before("lfoci-newton", '{"a": 1}', "random_1pct", 24.0),  # other settings
             ctx.timed_out_before("lfoci-newton", "{}", "random_1pct", 25.0)]        # a larger limit
    if scope == "run":
        assert all(why is not None and "timed out" in why for why in later)
    else:
        assert later == [None, None, None]
        ctx.note_timeout("salun", "{}", "class", "preparation", RowTimeout("stopped"), 24.0)
        assert ctx.timed_out_before("salun", "{}", "subject", 24.0) is not None    # a preparation: every scenario
        assert ctx.timed_out_before("salun", "{}", "subject", 30.0) is None


def test_tuning_breaks_avg_gap_ties_by_the_phi_gap() -> None:
    """The least mean Avg. Gap wins unless another setting is within AVG_GAP_TIE of it; among those, the least mean
    |phi gap| (the LiRA statistic's mean gap to Retrain on the forget set); a setting that failed a set is out."""
    from bench.deep_forgetting import AVG_GAP_TIE, choose_setting

    assert choose_setting([[0.2, 0.4], [3.0, 2.0]], [[0.5, 0.5], [0.0, 0.0]]) == (0, "least mean Avg. Gap on the tuning sets")
    best, why = choose_setting([[0.3], [0.3 + AVG_GAP_TIE / 2], [0.1 + AVG_GAP_TIE * 2]], [[0.34], [-0.05], [0.0]])
    assert best == 1 and "phi gap" in why                      # tied on Avg. Gap: the smaller |phi gap|
    assert choose_setting([[0.3], [0.5]], [[0.34], [-0.34]])[0] == 0   # equal |phi gap|: the smaller Avg. Gap
    assert choose_setting([[0.3, math.inf], [0.9, 0.8]], [[0.0, math.inf], [0.4, 0.4]])[0] == 1  # failed a set
    assert choose_setting([[math.inf], [math.inf]], [[math.inf], [math.inf]])[0] == 0


def test_ulira_reads_render_a_value_written_as_null() -> None:
    """A non-finite read (a removal whose logits blew up) is written as null by jsonable; the table says n/a
    instead of failing the run's checkpoint render."""
    from bench.deep_forgetting import render_ulira_reads

    finite = {"shift": 0.3, "shift_in_std": 1.0}
    cell = {"shadows": 4, "rows": {"a": {"accuracy": 60.0, "reads": {"phi": finite, "label": {"shift": None,
                                                                                             "shift_in_std": None},
                                                                      "others": {"shift": -0.2, "shift_in_std": None}}},
                                   "b": {"needs_retrain": "refused"}}}
    lines = render_ulira_reads(cell)
    assert "| a | +0.30 (+1.0 sd) | n/a | -0.20 |" in lines and not any(line.startswith("| b ") for line in lines)
    assert render_ulira_reads(None) == [] and render_ulira_reads({"shadows": 4, "rows": {"a": {"accuracy": 50.0}}}) == []


def test_a_campaign_whose_preparation_times_out_records_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """campaign() notes a preparation that ran past the limit, so that under timeout_scope "run" the row is not
    prepared again in a later scenario or request."""
    import pipeline.methods.base as base
    from bench.deep_forgetting import RowTimeout, campaign, campaign_sets, setup

    def too_slow(*args: object, **kwargs: object) -> None:
        raise RowTimeout("stopped after the row time limit of 3 s")

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ctx = setup("fmnist-cnn", "smoke", overrides={"timeout_scope": "run"})
        ctx.rows = ["finetune"]
        ctx.chosen[("finetune", "subject")] = {}
        monkeypatch.setattr(base, "prepare", too_slow)
        out = campaign(ctx, "subject", campaign_sets("subject", ctx.train, ctx.num_classes, 1))
    finally:
        torch.set_num_threads(threads)
    assert out["rows"]["finetune"]["error"].startswith("preparation: RowTimeout")
    assert "timed out" in (ctx.timed_out_before("finetune", "{}", "random_1pct", 1e9) or "")
    assert ctx.timed_out_before("salun", "{}", "random_1pct", 1e9) is None


def test_a_request_is_charged_everything_serving_it_took(monkeypatch: pytest.MonkeyPatch) -> None:
    """The seconds charged are the whole request's: a removal pays the check that the kept state holds (its binding's
    digest), a preparation its own binding, and a campaign's request the next version's state as well. With the
    weights' digest slowed by 0.25 s, a reported removal is charged at least one digest beyond its removal's own
    work, and each campaign request at least two (its check and the next version's binding)."""
    import time

    import pipeline.prepared as prepared
    from bench.deep_forgetting import campaign, campaign_sets, draw_forget_sets, setup

    original = prepared.state_digest

    def slow(model: torch.nn.Module) -> str:
        time.sleep(0.25)
        return original(model)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ctx = setup("fmnist-cnn", "smoke")
        ctx.original(0)
        ctx.rows = ["finetune"]
        ctx.chosen[("finetune", "subject")] = {}
        reported, _ = draw_forget_sets("subject", ctx.train, ctx.num_classes, 1, 0)
        monkeypatch.setattr(prepared, "state_digest", slow)
        out = ctx.remove("finetune", {}, 0, reported[0], seed=0)
        camp = campaign(ctx, "subject", campaign_sets("subject", ctx.train, ctx.num_classes, 2))
    finally:
        torch.set_num_threads(threads)
    assert out["preparation_seconds"] >= 0.25  # the state's own binding
    assert out["seconds"] >= out["record"]["removal_seconds"] >= 0.25
    row = camp["rows"]["finetune"]
    assert len(row["attempt_seconds"]) == 2 and all(row["served"])
    assert all(seconds >= 0.5 for seconds in row["attempt_seconds"]), row["attempt_seconds"]


@pytest.mark.parametrize("flag", ["--tuning-sets", "--tuning-retrains"])
def test_tuning_counts_below_one_are_refused_naming_the_flag(flag: str, capsys: pytest.CaptureFixture[str],
                                                              tmp_path: Path) -> None:
    """No tuning set, or a phi reference without a Retrain, would make the tuning fall back silently: refused at the
    command line with the flag named, exit 2, nothing written."""
    from bench import deep_forgetting

    with pytest.raises(SystemExit) as stop:
        deep_forgetting.main(["--dataset", "fmnist-cnn", "--smoke", flag, "0", "--out-dir", str(tmp_path)])
    assert stop.value.code == 2 and flag in capsys.readouterr().err and not any(tmp_path.iterdir())


def test_a_file_written_under_an_older_profile_names_the_flags_that_reproduce_it() -> None:
    """A committed file keeps the command it ran; where the profile changed since, the render says which flags make
    today's code run the same protocol (a file without ``tuning_retrains`` ran one Retrain), or which changed
    settings no flag sets."""
    from bench import deep_forgetting

    full = deep_forgetting.PROFILES["full"]["identities"]
    command = ["python", "-m", "bench.deep_forgetting", "--dataset", "identities", "--sets", "1"]
    now = json.loads(json.dumps({**full, "sets": 1}))  # as a file holds it (tuples written as lists)
    old = {"command": command, "profile": "full", "dataset": "identities",
           "profile_settings": {**{k: v for k, v in now.items() if k != "tuning_retrains"}, "tuning_sets": 1}}
    flags = [*command, "--tuning-sets", "1", "--tuning-retrains", "1"]
    assert deep_forgetting.reproduce_command(old) == (flags, [])
    assert deep_forgetting.reproduce_command({**old, "profile_settings": now}) == (None, [])  # today's profile
    given = {**old, "command": [*command, "--tuning-sets", "1"]}
    assert deep_forgetting.reproduce_command(given) == (flags, [])
    assert deep_forgetting.reproduce_command({**old, "dataset": "mnist"}) == (None, [])
    moved = {**old, "profile_settings": {**old["profile_settings"], "row_floor": 30.0, "mia": [1000, 2]}}
    assert deep_forgetting.reproduce_command(moved) == (flags, ["mia", "row_floor"])


def test_every_committed_tuning_grid_is_valid_settings_and_a_bad_point_is_named(tmp_path: Path) -> None:
    """Every point of every committed grid is valid settings of its row's method (variant + base + point), checked
    when the file loads; a point no removal can run (SCRUB with max_steps above its epochs) is refused there, the
    file, the row and the point named, not recorded as a refused row hours into a run."""
    from bench import deep_forgetting

    for dataset in deep_forgetting.DATASETS:
        tuning = deep_forgetting.load_tuning(dataset)
        assert tuning["size"] >= 1 and tuning["rows"]
    others = sorted((deep_forgetting.CONFIGS / "tuning").rglob("*/*.yaml"))  # the sweeps', timings' and brief runs' grids
    assert {p.parent.name for p in others} == {"brief", "sweeps", "timing"}
    for path in others:
        assert deep_forgetting.load_tuning("identities", path)["rows"], path
    bad = tmp_path / "grid.yaml"
    bad.write_text("size: 2\ndefault: {base: {}, lr_factors: [1.0, 3.0]}\nrows:\n  scrub:\n"
                   "    base: {epochs: 1}\n    grid: [{lr: 0.001, max_steps: 1}, {lr: 0.01}]\n")
    with pytest.raises(ValueError, match=r"(?s)rows\.scrub\.grid\[1\].*max_steps \(2\) exceeds epochs \(1\)"):
        deep_forgetting.load_tuning("fmnist-cnn", bad)


def test_a_removal_whose_outputs_overflow_is_recorded_not_scored(monkeypatch: pytest.MonkeyPatch) -> None:
    """A removal can leave finite weights whose logits pass float range (gradient ascent at a large rate did, on the
    identities model): the MIA's SVC cannot take them. Tuning and the reported set record the row's error and the
    run goes on; the other rows are scored as before."""
    from bench import deep_forgetting as df

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ctx = df.setup("fmnist-cnn", "smoke")
        ctx.rows = ["finetune", "salun"]
        real_remove = df.Context.remove

        def overflowing(self: df.Context, row: str, *args: object, **kwargs: object) -> dict:
            res = real_remove(self, row, *args, **kwargs)
            if row == "finetune" and "model" in res:
                last = [m for m in res["model"].modules() if isinstance(m, torch.nn.Linear)][-1]
                with torch.no_grad():       # finite weights, logits past float32's range (3e38 + 3e38 h)
                    last.weight.fill_(3e38)
                    last.bias.fill_(3e38)
                assert all(bool(torch.isfinite(p).all()) for p in res["model"].parameters())
            return res

        monkeypatch.setattr(df.Context, "remove", overflowing)
        reported, tuning = df.draw_forget_sets("subject", ctx.train, ctx.num_classes, 1, 1)
        tuned = df.tune_scenario(ctx, "subject", tuning)
        scored = df.run_set(ctx, reported[0], 0)
    finally:
        torch.set_num_threads(threads)
    finetune = tuned["rows"]["finetune"]["points"][0]["per_set"][0]
    assert finetune["error"].startswith("NonFiniteOutputs") and "AvgGap" not in finetune
    assert math.isfinite(tuned["rows"]["salun"]["points"][0]["mean_AvgGap"])
    row = scored["rows"]["finetune"]
    assert row["served"] is False and row["error"].startswith("NonFiniteOutputs") and row["cold_seconds"] > 0
    assert scored["rows"]["salun"]["served"] is True and math.isfinite(scored["rows"]["salun"]["AvgGap"])


def test_a_tuning_only_sweep_runs_the_full_runs_tuning_sets_and_nothing_reported(tmp_path: Path, one_thread) -> None:
    """--tuning-only with a sweep grid: the sets are drawn as the same flags draw them for a full run, so the tuning
    sets are that run's (disjoint from its reported sets); only they run (no reported set, no campaign), on the
    sweep file's grid; the file is *_sweep.json and its table lists every point."""
    from bench import deep_forgetting as df

    grid = tmp_path / "sweep.yaml"
    grid.write_text("size: 2\ndefault: {base: {}, lr_factors: [1.0, 3.0]}\nrows:\n  finetune:\n"
                    "    base: {epochs: 1}\n    grid: [{lr: 0.001}, {lr: 0.01}]\n")
    code = df.main(["--dataset", "fmnist-cnn", "--smoke", "--threads", "1", "--scenarios", "subject",
                    "--methods", "finetune", "--tuning-only", "--tuning-grid", str(grid), "--out-dir", str(tmp_path)])
    assert code == 0
    out = json.loads((tmp_path / "deep_fmnist-cnn_smoke_partial_subject_sweep.json").read_text())
    assert out["tuning_only"] is True and out["scenarios"] == {} and out["tuning"]["file"] == str(grid)
    points = out["tuning"]["scenarios"]["subject"]["rows"]["finetune"]["points"]
    cap = df.PROFILES["smoke"]["fmnist-cnn"].get("grid") or 2   # the smoke profile runs the grid's first points
    assert [p["settings"]["lr"] for p in points] == [0.001, 0.01][:cap] and all("AvgGap" in p["per_set"][0] for p in points)
    ctx = df.setup("fmnist-cnn", "smoke")
    reported, tuning = df.draw_forget_sets("subject", ctx.train, ctx.num_classes, int(ctx.profile["sets"]),
                                           int(ctx.profile["tuning_sets"]))
    declared = out["declared_sets"]["subject"]
    assert [s["sample_ids"] for s in declared["tuning"]] == [fs.describe()["sample_ids"] for fs in tuning]
    assert [s["sample_ids"] for s in declared["reported"]] == [fs.describe()["sample_ids"] for fs in reported]
    assert not set(declared["tuning"][0]["sample_ids"]) & set(declared["reported"][0]["sample_ids"])
    table = (tmp_path / "deep_fmnist-cnn_smoke_partial_subject_sweep.md").read_text()
    assert "Tuning only (a sweep)" in table and table.count("| finetune |") == len(points)
    assert "no reported set ran" in df.render_summary(out)   # what the results page shows of it
    # a sweep of another grid over the same scenarios: a file of its own, the first left as it was
    first = (tmp_path / "deep_fmnist-cnn_smoke_partial_subject_sweep.json").read_bytes()
    other = tmp_path / "other.yaml"
    other.write_text(grid.read_text().replace("lr: 0.001", "lr: 0.002"))
    assert df.main(["--dataset", "fmnist-cnn", "--smoke", "--threads", "1", "--scenarios", "subject", "--methods",
                    "finetune", "--tuning-only", "--tuning-grid", str(other), "--out-dir", str(tmp_path)]) == 0
    assert (tmp_path / "deep_fmnist-cnn_smoke_partial_subject_sweep.json").read_bytes() == first
    again = json.loads((tmp_path / "deep_fmnist-cnn_smoke_partial_subject_sweep-other.json").read_text())
    assert again["tuning"]["file"] == str(other)
    assert df.sweep_of_another_grid(tmp_path / "deep_fmnist-cnn_smoke_partial_subject_sweep.json", grid) is False
    # the same grid with reported sets: a file of its own, never the default grid's
    assert df.main(["--dataset", "fmnist-cnn", "--smoke", "--threads", "1", "--scenarios", "subject", "--methods",
                    "finetune", "--campaign", "0", "--tuning-grid", str(grid), "--out-dir", str(tmp_path)]) == 0
    ran = json.loads((tmp_path / "deep_fmnist-cnn_smoke_partial_subject_grid-sweep.json").read_text())
    assert ran["tuning_only"] is False and ran["tuning"]["file"] == str(grid) and "subject" in ran["scenarios"]


def test_a_sweep_gives_each_row_its_points_with_the_least_mean_avg_gap() -> None:
    """grid_from_sweep: per row, the points with the least mean Avg. Gap over every swept scenario's tuning sets, a
    failed set counting SWEEP_FAILED_GAP, kept in the sweep's order."""
    from bench.deep_forgetting import SWEEP_FAILED_GAP, grid_from_sweep

    def point(lr: float, *gaps: float | None) -> dict:
        return {"settings": {"lr": lr}, "per_set": [{"AvgGap": g} if g is not None else {"error": "x"} for g in gaps]}

    sweep = {"tuning": {"scenarios": {
        "a": {"rows": {"ga": {"points": [point(1, 10.0), point(2, 5.0), point(3, None), point(4, 1.0)]}}},
        "b": {"rows": {"ga": {"points": [point(1, 10.0), point(2, 30.0), point(3, 0.0), point(4, 2.0)]}}}}}}
    # means: 10, 17.5, 50 (a failed set counts 100), 1.5 -> the two least: lr 4 and lr 1, in the sweep's order
    assert SWEEP_FAILED_GAP == 100.0
    assert grid_from_sweep(sweep, 2) == {"ga": [{"lr": 1}, {"lr": 4}]}
    assert grid_from_sweep(sweep, 3) == {"ga": [{"lr": 1}, {"lr": 2}, {"lr": 4}]}


@pytest.mark.parametrize("dataset, sweep, rows", [
    ("identities", "deep_identities_partial_identity-random_1pct-random_10pct-subject_sweep.json",
     ("gradient-ascent", "neggrad-plus", "scrub", "l1-sparse")),
    ("r8-minilm", "deep_r8-minilm_partial_class_sweep.json",
     ("gradient-ascent", "random-labels", "neggrad-plus", "scrub", "l1-sparse")),
])
def test_committed_grids_are_what_the_rule_picks_from_the_committed_sweep(dataset: str, sweep: str,
                                                                          rows: tuple[str, ...]) -> None:
    """The grids of the rows a sweep placed are, point for point, grid_from_sweep of that sweep's committed result,
    and the sweep ran on tuning sets disjoint from every set it drew as reported (nothing reported ran)."""
    from bench import deep_forgetting as df

    result = json.loads((df.RESULTS_DIR / sweep).read_text())
    assert result["tuning_only"] is True and result["scenarios"] == {}
    for declared in result["declared_sets"].values():
        reported = {i for s in declared["reported"] for i in s["sample_ids"]}
        assert not reported & {i for s in declared["tuning"] for i in s["sample_ids"]}
    tuning = df.load_tuning(dataset)
    picked = df.grid_from_sweep(result, int(tuning["size"]))
    for row in rows:
        assert df.grid_for(row, tuning)[0] == picked[row], row


def _charged_block() -> dict:
    """A scenario's block as a run records it now. D holds 104 samples. Two tuning sets (m = 4 and 2) with their
    Retrains, two reported sets (m = 4 and 8) with their Retrain and retrain-reseed: the least seconds (58 s, on 96
    retained samples) is not the least rate (61.2 s on 102: 0.6 s a sample). A served row and a refused one; a
    campaign of three requests of 4, 8 and 2 samples, the second refused."""
    def run(m: int, retrain: float, reseed: float, served_s: float, attempt: float) -> dict:
        return {"m": m, "retrain_seconds": retrain, "rows": {
            "original": {"AvgGap": 9.0, "seconds": 0.0}, "retrain": {"AvgGap": 0.0, "seconds": retrain},
            "retrain-reseed": {"AvgGap": 1.0, "seconds": reseed},
            "fast": {"UA": 1.0, "AvgGap": 2.0, "seconds": served_s, "preparation_seconds": 0.0,
                     "cold_seconds": served_s, "served": True},
            "refused": {"needs_retrain": "no local step", "attempt_seconds": attempt, "served": False}}}

    timings = [(70.0, 100), (61.2, 102), (100.0, 100), (80.0, 100), (58.0, 96), (90.0, 96)]
    return {"runs": [run(4, 100.0, 80.0, 10.0, 4.0), run(8, 58.0, 90.0, 6.0, 3.0)],
            "retrain_seconds": [70.0, 61.2, 100.0, 58.0],
            "retrain_timings": [{"seconds": t, "retained": r} for t, r in timings],
            "campaign": {"requests": 3, "sizes": [4, 8, 2], "retained_before": 104, "rows": {
                "fast": {"preparation_seconds": 3.0, "attempt_seconds": [2.0, 5.0, 2.0], "served": [True, False, True]},
                "broken": {"error": "preparation: RowTimeout"}}}}


def test_ratios_charge_the_fastest_retrain_of_the_same_work() -> None:
    """A reported set's cold ratio charges the lesser of its Retrain and retrain-reseed (both timed next to its
    removals). A campaign's request is charged the Retrain of what D holds after it (the requests before it and
    itself removed), at the least seconds per retained sample timed on the scenario; an unserved row or request
    pays its attempt and then that Retrain. Exact figures on a hand-made block."""
    from bench.deep_forgetting import charge

    block = _charged_block()
    charge(block)
    first, second = block["runs"]
    assert first["retrain_seconds_charged"] == 80.0 and second["retrain_seconds_charged"] == 58.0
    assert first["rows"]["fast"]["cold_x"] == pytest.approx(8.0)
    assert second["rows"]["fast"]["cold_x"] == pytest.approx(58.0 / 6.0)
    assert first["rows"]["refused"]["cold_seconds"] == pytest.approx(84.0)   # the attempt, then Retrain
    assert first["rows"]["refused"]["cold_x"] == pytest.approx(80.0 / 84.0)
    camp = block["campaign"]
    assert camp["retrain_seconds_per_retained_sample"] == pytest.approx(0.6)  # a tuning set's: the least rate
    assert camp["retrain_seconds_charged"] == pytest.approx([60.0, 55.2, 54.0])  # on 100, 92 and 90 retained
    fast = camp["rows"]["fast"]
    assert fast["request_seconds"] == pytest.approx([2.0, 60.2, 2.0])
    assert fast["per_request_seconds"] == pytest.approx(67.2 / 3)
    assert fast["request_x"] == pytest.approx(169.2 / 67.2)
    assert "request_x" not in camp["rows"]["broken"]
    summary = block["summary"]
    assert summary["fast"]["cold_x"]["mean"] == pytest.approx((8.0 + 58.0 / 6.0) / 2)
    assert summary["fast"]["request_x"]["mean"] == pytest.approx(169.2 / 67.2)
    assert summary["fast"]["served"]["mean"] == pytest.approx(100.0 * 4 / 5)
    assert summary["refused"]["served"]["mean"] == 0.0 and "request_x" not in summary["refused"]
    untimed = _charged_block()
    untimed["retrain_timings"] = []
    charge(untimed)  # no Retrain timed on the scenario: no per-request ratio, rather than 0
    assert untimed["campaign"]["rows"]["fast"]["request_x"] is None


def _written_before(block: dict, *, attempts_apart: bool) -> dict:
    """``block`` as an older run wrote it, before its timings were recorded with their retained sizes; and, where
    not ``attempts_apart``, before the attempts were recorded apart: an unserved row's cold seconds held its set's
    Retrain, an unserved request's seconds the scenario's mean Retrain (``retrain_seconds_charged``)."""
    del block["retrain_timings"]
    camp = block["campaign"]
    del camp["retained_before"]
    mean = 77.0
    camp["retrain_seconds_charged"] = mean
    if attempts_apart:  # as the first re-derivation left the committed files: the rule's text, a float charge
        block["retrain_charge"] = "the least Retrain timed on the scenario"
        return block
    for run in block["runs"]:
        row = run["rows"]["refused"]
        row["cold_seconds"] = row.pop("attempt_seconds") + run["retrain_seconds"]
    fast = camp["rows"]["fast"]
    fast["request_seconds"] = [a + (0.0 if ok else mean) for a, ok in zip(fast.pop("attempt_seconds"), fast["served"])]
    return block


@pytest.mark.parametrize("attempts_apart", [False, True])
def test_a_file_written_under_an_older_charge_is_recharged_from_its_attempts(attempts_apart: bool) -> None:
    """``recharged`` takes an older file's charge back out of its unserved rows and requests, rebuilds its Retrain
    timings with their retained sizes from its tuning sets (in their order) and reported sets, then charges as a run
    does now: the same figures as a block recorded with its attempts and timings apart. A second pass changes
    nothing."""
    import copy

    from bench.deep_forgetting import charge, recharged

    now = _charged_block()
    charge(now)
    tuning = {"scenarios": {"subject": {"sets": [{"m": 4}, {"m": 2}]}}}
    result = recharged({"data": {"n_train": 104}, "tuning": tuning,
                        "scenarios": {"subject": _written_before(_charged_block(), attempts_apart=attempts_apart)}})
    got = result["scenarios"]["subject"]
    assert got["summary"] == now["summary"] and got["campaign"] == now["campaign"]
    assert got["retrain_timings"] == now["retrain_timings"]
    assert [r["rows"]["refused"]["attempt_seconds"] for r in got["runs"]] == [4.0, 3.0]
    assert recharged(copy.deepcopy(result)) == result


def test_an_older_file_whose_charge_cannot_be_rebuilt_is_refused() -> None:
    """Timings that cannot be matched to their tuning sets, or a campaign that does not say what it charged, raise
    (naming the scenario) rather than charge a Retrain at the wrong rate or twice."""
    from bench.deep_forgetting import recharged

    old = _written_before(_charged_block(), attempts_apart=False)
    with pytest.raises(ValueError, match="scenario subject: 4 Retrain seconds for 1 tuning and 2 reported sets"):
        recharged({"data": {"n_train": 104}, "tuning": {"scenarios": {"subject": {"sets": [{"m": 4}]}}},
                   "scenarios": {"subject": old}})
    old = _written_before(_charged_block(), attempts_apart=False)
    del old["campaign"]["retrain_seconds_charged"]
    with pytest.raises(ValueError, match="scenario subject: campaign.retrain_seconds_charged is missing"):
        recharged({"data": {"n_train": 104}, "tuning": {"scenarios": {"subject": {"sets": [{"m": 4}, {"m": 2}]}}},
                   "scenarios": {"subject": old}})


def test_ulira_played_on_several_sets_is_pooled_per_row() -> None:
    """--ulira-sets k: the cell's game is played on each of its first k reported sets and pooled per row (the
    accuracy over all their decisions, its interval over all their examples); the summary's U-LiRA is the pooled
    one; the table shows the pooled game and each set's reads; a row with no game on some set is not pooled."""
    from bench import deep_forgetting
    from bench.deep_forgetting import render_markdown, ulira_of_cell

    with pytest.raises(SystemExit) as exit_info:  # the command line refuses before any work, naming the flag
        deep_forgetting.main(["--dataset", "identities", "--smoke", "--ulira-sets", "2"])
    assert exit_info.value.code == 2
    with pytest.raises(ValueError, match="ulira_sets"):
        deep_forgetting.run("identities", profile="smoke", scenarios=("random_1pct",), methods=["finetune"],
                            overrides={"sets": 1, "ulira_sets": 2})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = deep_forgetting.run("identities", profile="smoke", scenarios=("random_1pct",), methods=["finetune"],
                                     overrides={"sets": 2, "ulira_sets": 2})
    finally:
        torch.set_num_threads(threads)
    block = result["scenarios"]["random_1pct"]
    games = [run["ulira"] for run in block["runs"]]
    assert [g["forget_set"] for g in games] == [0, 1]
    cell = block["ulira"]
    assert cell["forget_sets"] == [0, 1] and cell["shadows"] == result["shadows"]
    for row in ("original", "finetune"):
        pooled, own = cell["rows"][row], [g["rows"][row] for g in games]
        n = [g["examples"] for g in own]
        assert pooled["examples"] == sum(n)
        assert pooled["accuracy"] == pytest.approx(sum(k * g["accuracy"] for k, g in zip(n, own)) / sum(n))
        assert [p["accuracy"] for p in pooled["per_set"]] == [g["accuracy"] for g in own]
        assert pooled["ci95"][0] <= pooled["accuracy"] <= pooled["ci95"][1]
        assert block["summary"][row]["ULiRA"]["mean"] == pooled["accuracy"]
        assert block["summary"][row]["ULiRA_ci95"] == pooled["ci95"]
    table = render_markdown(json.loads(json.dumps(result)))
    assert "shadow pairs on the first 2 sets (pooled)" in table
    assert "U-LiRA pooled over forget sets 0, 1" in table
    assert "U-LiRA reads on forget set 0" in table and "U-LiRA reads on forget set 1" in table
    # read only where the original scores at least pipeline.evaluate.lira.ATTACKABLE on every set, not on the pool alone
    strong = json.loads(json.dumps(games))
    for g, acc in zip(strong, (100.0, 55.0)):
        g["rows"]["original"]["accuracy"] = acc
    weak = ulira_of_cell(strong)
    assert not weak["attackable"] and "under 60 on set(s) 1" in weak["note"]
    strong[1]["rows"]["original"]["accuracy"] = 60.0
    assert ulira_of_cell(strong)["attackable"]
    # a row refused on a later set's shadows, or absent from the first set's game, is not pooled and says where;
    # the summary then holds no U-LiRA figure for it (not the mean of the sets it has)
    refused = json.loads(json.dumps(games))
    refused[1]["rows"]["finetune"] = {"needs_retrain": ["no step serves"], "shadow": 2}
    partial = ulira_of_cell(refused)
    assert "accuracy" not in partial["rows"]["finetune"]
    assert partial["rows"]["finetune"]["not_pooled"] == "no game on forget set 1"
    assert partial["rows"]["finetune"]["needs_retrain"] == ["no step serves"]
    absent = json.loads(json.dumps(games))
    del absent[0]["rows"]["finetune"]
    assert ulira_of_cell(absent)["rows"]["finetune"]["not_pooled"] == "no game on forget set 0"
    reblock = json.loads(json.dumps(block))
    reblock["ulira"] = partial
    deep_forgetting.charge(reblock)
    assert "ULiRA" not in reblock["summary"]["finetune"] and "ULiRA_ci95" not in reblock["summary"]["finetune"]
    assert reblock["summary"]["original"]["ULiRA"]["mean"] == partial["rows"]["original"]["accuracy"]
    shown = json.loads(json.dumps(result))
    shown["scenarios"]["random_1pct"] = reblock
    assert "| finetune | not pooled: no game on forget set 1 | - | - |" in render_markdown(shown)
    # recharging a written file keeps the pooled figures
    again = deep_forgetting.recharged(json.loads(json.dumps(result)))
    assert again["scenarios"]["random_1pct"]["summary"]["finetune"]["ULiRA"] == block["summary"]["finetune"]["ULiRA"]
    assert ulira_of_cell(games[:1]) is games[0] and ulira_of_cell([]) is None
