"""The box kit: it refuses what is missing before loading anything, and a dry run on the stand-in pair
(CPU, tiny sizes) and on the made-to-format real pair (TP=2 over gloo) writes stamped rows to its results
folder, one file per topic, that the projection's readers take as they take the box's."""
from pathlib import Path

import pytest

from kdtree_lib import box, projection, results, routing
from kdtree_lib.model import load_config
from kdtree_lib.pair_reference import save_kimi_pair
from kdtree_lib.pairs import stand_in_paths

TARGET, DRAFTER = stand_in_paths(8)
TINY = dict(device="cpu", dtype="float32", budgets=(1, 4, 8), live_budgets=(4,), prompts_per_package=1,
            prompt_tokens=24, new_tokens=12, batches=(1, 2), contexts=(48,), nodes=(1, 4, 8), union_sequences=2,
            union_length=32, union_windows=4, repeats=1, warmup=0, progress=False)
needs_stand_in = pytest.mark.skipif(not (TARGET / "config.json").is_file(), reason="no stand-in checkpoint")


def kit(tmp_path, target=TARGET, drafter=DRAFTER, **overrides) -> box.KitSettings:
    return box.KitSettings(target=str(target), drafter=str(drafter), results_dir=str(tmp_path / "rows"),
                           **{**TINY, **overrides})


@pytest.mark.parametrize("missing", ["target", "drafter", "tokenizer"])
def test_refuses_missing_paths_naming_them(tmp_path, missing):
    settings = kit(tmp_path, **{missing: str(tmp_path / "nowhere")})
    with pytest.raises(ValueError, match=f"^{missing}: .*nowhere"):
        box.run_kit(settings)
    assert not (tmp_path / "rows").exists(), "nothing is written before the paths are checked"


def test_command_line_refuses_clearly(tmp_path, capsys):
    code = box.main(["--target", str(tmp_path / "nowhere"), "--drafter", str(DRAFTER), "--results-dir",
                     str(tmp_path / "rows"), "--device", "cpu"])
    assert code == 2 and "target: no checkpoint at" in capsys.readouterr().err
    with pytest.raises(ValueError, match="steps"):
        box.check_settings(kit(tmp_path, steps=("acceptance", "dance")))
    with pytest.raises(ValueError, match="drafter_placement"):
        box.check_settings(kit(tmp_path, drafter_placement="everywhere"))


@needs_stand_in
def test_the_memory_plan_refuses_what_does_not_fit(tmp_path):
    from kdtree_lib.memory import MemoryPlanError
    settings = kit(tmp_path, batches=(8,), contexts=(32768,), nodes=(1, 257))
    plan = box.memory_plan(settings, 2, gpu_bytes=96 * 10**9)  # the stand-in at the box's sizes fits a box GPU
    assert plan.fits and plan.batch == 8 and plan.context >= 32768 + 257
    with pytest.raises(MemoryPlanError, match="batch/context/tp"):
        box.memory_plan(settings, 2, gpu_bytes=10**6).check()


def read_back(settings: box.KitSettings) -> dict[str, list[dict]]:
    return {topic: results.read_rows(topic, results_dir=settings.results_dir) for topic in set(box.TOPICS.values())}


@needs_stand_in
def test_stand_in_dry_run_writes_rows_the_projection_reads(tmp_path):
    settings = kit(tmp_path)
    written = box.run_kit(settings)
    rows = read_back(settings)
    assert {topic: len(rows[topic]) for topic in written} == written and all(written.values())
    for topic_rows in rows.values():  # stamped, one run
        assert all(r["date"] and r["commit"] and r["device"] for r in topic_rows)
        assert len({r["run"] for r in topic_rows}) == 1
    assert [r["step"] for r in rows["box_steps"]] == list(box.STEPS)

    source = projection.measured_acceptance("real pair", "box_acceptance.csv", rows["box_acceptance"], depth=7)
    assert sorted(source.curve) == [1, 4, 8] and source.measured and source.chain.measured
    assert all(1 <= a <= 8 for a in source.curve.values()) and source.curve[1] <= source.curve[8]
    config = load_config(TARGET)
    fitted = routing.fit_correlation(rows["box_expert_union"], config.n_routed_experts, config.num_experts_per_tok)
    assert 0 <= fitted <= 0.999
    verify = rows["box_verify_step"]
    layers = projection.select_rows(verify, "layer")
    assert {int(r["nodes"]) for r in layers} == {1, 4, 8} and {int(r["batch"]) for r in layers} == {1, 2}
    assert len(projection.whole_model_rows(verify, config)) == 2 * 3  # (batch, nodes), eager
    drafts = projection.select_rows(verify, "draft")
    assert drafts and all(r["tree_timing"] == "host_reference" and float(r["drafter_seconds"]) > 0 for r in drafts)
    # the depth structure from the same oracle records, at the depth budgets the recorded top-k covers
    depth = projection.depth_source("real pair", "box_acceptance_depth.csv", rows["box_acceptance_depth"])
    assert sorted(depth.structures) == [4, 8] and {r["package"] for r in rows["box_acceptance_depth"]} == \
        {r["package"] for r in rows["box_acceptance"]}
    for budget, s in depth.structures.items():  # the same rounds as the oracle's tree rows of that budget
        oracle = [r for r in rows["box_acceptance"] if r["source"] == "oracle" and r["mode"] == "tree"
                  and int(r["budget"]) == budget]
        assert s.rounds == sum(int(r["rounds"]) for r in oracle)
        tokens = sum(int(r["rounds"]) * float(r["mean_acceptance"]) for r in oracle)  # the rows' means, unrounded
        assert s.tokens == round(tokens) and abs(s.tokens - tokens) < 1e-6 * tokens
    assert all(r["real_shape"] == "False" for r in verify + rows["box_expert_union"])


def test_made_to_format_pair_dry_run_at_tp2_over_gloo(tmp_path):
    target, drafter = save_kimi_pair(tmp_path / "pair")
    settings = kit(tmp_path, target=target, drafter=drafter, steps=("verify", "union", "drafter"), batches=(1,),
               nodes=(1, 4))
    written = box.run_kit(settings, tp=2)
    rows = read_back(settings)
    assert written == {"box_verify_step": len(rows["box_verify_step"]), "box_expert_union": len(rows["box_expert_union"])}
    assert projection.select_rows(rows["box_verify_step"], "draft"), "the sharded drafter's forward is timed"
    assert {int(r["tp"]) for r in rows["box_verify_step"]} == {2}
    assert {r["drafter_placement"] for r in rows["box_verify_step"]} == {"sharded"}  # decode_tp.generate_tp's default
    assert any(float(r["allreduce_seconds"]) > 0 for r in projection.select_rows(rows["box_verify_step"], "layer"))
    assert Path(settings.results_dir, "box_steps.csv").is_file()


def test_real_shapes_run_the_timing_steps_and_skip_acceptance(tmp_path, capsys):
    """--real-shapes LAYERS: bench.inputs.real_shape_pair at the shapes of the configs named (here the made-to-format
    pair's, small; on the box K2.6's by default) with random weights, no checkpoint read: the timing steps write
    rows stamped real_shape and layers that the projection's readers take; acceptance is skipped with its reason."""
    target, drafter = save_kimi_pair(tmp_path / "pair")
    rows_dir = tmp_path / "rows"
    options = ["--device", "cpu", "--budgets", "1", "4", "--batches", "1", "2", "--contexts", "48", "--nodes", "1", "4", "8",
               "--union-sequences", "2", "--union-length", "32", "--union-windows", "4", "--repeats", "1", "--warmup", "0",
               "--no-progress", "--results-dir", str(rows_dir)]
    assert box.main(["--real-shapes", "2", "--target", str(target / "config.json"), "--drafter", str(drafter)] + options) == 0
    printed = capsys.readouterr().out
    assert "acceptance: skipped: random weights" in printed
    rows = {topic: results.read_rows(topic, results_dir=rows_dir) for topic in set(box.TOPICS.values())}
    assert not rows["box_acceptance"] and not rows["box_acceptance_depth"]
    steps = {r["step"]: r for r in rows["box_steps"]}
    assert list(steps) == list(box.STEPS) and steps["acceptance"]["skipped"].startswith("random weights")
    assert all(int(steps[s]["rows"]) > 0 and not steps[s]["skipped"] for s in box.TIMING_STEPS)
    assert len({r["load_seconds"] for r in rows["box_steps"]}) == 1 and float(steps["verify"]["load_seconds"]) > 0
    table = box.steps_table(rows["box_steps"])  # printed at the end of the run: docs/box-kit.md's timing table
    assert "\n".join(table) in printed and table[4].startswith("| make the pair | | ")
    assert table[5].startswith("| acceptance | 0 | skipped: random weights") and table[6].startswith("| verify | ")
    total = float(steps["verify"]["load_seconds"]) + sum(float(r["wall_seconds"]) for r in rows["box_steps"])
    assert table[-1] == f"| total | | {total:.1f} |"
    timed = rows["box_verify_step"] + rows["box_expert_union"]
    assert {(r["real_shape"], r["layers"], r["expert_bits"]) for r in timed} == {("True", "2", "4.5")}
    assert {r["pair"] for r in timed} == {"real-shapes-2L:config+drafter"}
    config = box.kit_configs(box.KitSettings(target=str(target), drafter=str(drafter), results_dir=None, real_shapes=2))[0]
    assert config.num_hidden_layers == 2
    assert len(projection.whole_model_rows(rows["box_verify_step"], config)) == 2 * 3  # (batch, nodes), eager
    assert projection.select_rows(rows["box_verify_step"], "draft")


def test_real_shapes_refuse_what_they_cannot_measure(tmp_path, capsys):
    def refused(argv) -> str:
        assert box.main(argv + ["--device", "cpu", "--results-dir", str(tmp_path / "rows")]) == 2
        return capsys.readouterr().err
    assert "--target and --drafter are required (or --real-shapes LAYERS" in refused([])
    assert "steps: with real_shapes only" in refused(["--real-shapes", "2", "--steps", "acceptance"])
    assert "tp: a real-shape pair is made on one device" in refused(["--real-shapes", "2", "--tp", "2"])
    assert "target: no config at" in refused(["--real-shapes", "2", "--target", str(tmp_path / "nowhere")])
    assert "argument --real-shapes" in refused(["--real-shapes", "0"])
    assert not (tmp_path / "rows").exists() or not any((tmp_path / "rows").iterdir())


def test_the_real_shape_run_of_the_defaults_fits_one_h200():
    """--real-shapes 4 at the kit's default sizes (batch 8, context 32768 + 256 nodes): K2.6's first 4 layers and
    the real drafter's shapes, its feature layers clamped to the layers made; the memory plan fits one H200."""
    settings = box.KitSettings(target="", drafter="", results_dir=None, real_shapes=4)
    config, drafter = box.kit_configs(settings)
    assert config.num_hidden_layers == 4 and config.n_routed_experts == 384 and drafter.hidden_size == 7168
    assert drafter.target_layer_ids == (1, 3, 3, 3, 3, 3)
    plan = box.memory_plan(settings, 1, gpu_bytes=139 * 2**30)
    assert plan.fits and plan.batch == 8 and plan.context >= 32768 + 256
