"""`compactrl config show` / `config reference`: the printed config loads back to an equal one, and
docs/config.md is what the models generate now, with every field described."""

import importlib.util
import math
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from compactrl.cli import app
from compactrl.config import load_config
from compactrl.config_reference import KINDS, REGENERATE, reference, resolve, show, toml_value, undescribed

ROOT = Path(__file__).resolve().parent.parent
NOT_RUNS = {"studies", "bench", "serve"}  # study grids, bench configs: not train or rollout configs
CONFIGS = sorted(p for p in (ROOT / "configs").rglob("*.toml") if not NOT_RUNS & set(p.parts))
runner = CliRunner()
QUICKSTART = str(ROOT / "configs/quickstart.toml")


def said(r) -> str:
    """The command's output with rich's line wrapping undone."""
    return " ".join(r.output.split())


def test_docs_config_md_is_generated_from_the_models():
    assert (ROOT / "docs" / "config.md").read_text(encoding="utf-8") == reference(), (
        f"docs/config.md is out of date; regenerate it: {REGENERATE}"
    )


def test_every_field_has_a_description():
    missing = undescribed()
    assert not missing, f"fields without Field(description=...): {missing}; add one, then run {REGENERATE}"


def test_reference_covers_every_variant_and_section():
    text = reference()
    for name in ("count", "recall", "rooms", "textworld"):
        assert f'### `env.name = "{name}"`' in text
    for name in ("none", "sliding_window", "markovian", "summary", "pick", "evict_steps", "random_cursors"):
        assert f'### `strategy.name = "{name}"`' in text
    for row in ("`engine.kv_pool_tokens`", "`rollout.top_p`", "`train.lr`", "`train.lora.r`", "`model.path`"):
        assert row in text
    # a default the two kinds of config set differently shows both
    assert "| `rollout.max_tokens` | int, >= 1 | train: `4`; rollout: `64` |" in text
    # the optional evictor: one table per method, off by default, its budget required
    for name in ("h2o", "snapkv", "rkv", "streamingllm", "tova", "knorm", "random"):
        assert f'### `evictor.name = "{name}"`' in text
    assert "| `evictor.budget` | int, > 0 | required |" in text and "(default: unset)" in text


def test_set_switches_the_evictor_and_an_empty_value_removes_it():
    from compactrl.config import load_config
    from compactrl.rl.loop import TrainConfig

    path = ROOT / "configs" / "evictors" / "recall_h2o.toml"
    assert load_config(TrainConfig, path).evictor.name == "h2o"
    tova = load_config(TrainConfig, path, ["evictor.name=tova"]).evictor
    assert tova.name == "tova" and tova.budget == 112  # h2o's own fields (none here) would be dropped
    assert load_config(TrainConfig, path, ["evictor="]).evictor is None
    assert load_config(TrainConfig, path, ["out="]).out == ""  # a value, not a section: set to ""


def _fake_model(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text("{}")
    return d


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(ROOT / "configs")))
def test_every_config_round_trips_through_show(path, tmp_path):
    data = tomllib.loads(path.read_text())
    if data.get("env", {}).get("name") == "textworld" and importlib.util.find_spec("textworld") is None:
        pytest.skip("the textworld package is not installed")
    overrides = [f"model.path={_fake_model(tmp_path)}"] if "path" in data.get("model", {}) else []
    kind, cfg = resolve(path, overrides)  # the kind is told from the file
    assert kind == ("rollout" if "episodes" in data else "train")
    printed = tmp_path / "printed.toml"
    printed.write_text(show(path, overrides))
    assert load_config(KINDS[kind], printed) == cfg


@pytest.mark.parametrize("kind", list(KINDS))
def test_defaults_and_awkward_values_round_trip(kind, tmp_path):
    overrides = [
        'rollout.system="a \\"quoted\\"\\nline\\ttab \\\\ back é ☃ \\u007f \\u0001"',
        "rollout.chat_template_kwargs={enable_thinking = false, n = 2, x = 0.5, l = [1, 2], t = {a = 'b'}}",
        "strategy.name=summary",
        "strategy.trigger=every",
        "engine.compact_holes=1e-3",
    ]
    if kind == "train":
        overrides += ["train.lora.r=4", "train.lora.targets=['q_proj']", "train.eps=1e-12"]
        overrides += ["objective.gamma=1"]
    _, cfg = resolve(None, overrides, kind)
    assert cfg.rollout.system == 'a "quoted"\nline\ttab \\ back é ☃ \x7f \x01'
    text = show(None, overrides, kind)
    assert "# system = (unset)" in text  # env.system: TOML has no null
    printed = tmp_path / "printed.toml"
    printed.write_text(text)
    assert load_config(KINDS[kind], printed) == cfg


def test_toml_values_parse_back():
    values = [0, -3, True, False, 0.1, 1e-08, -2.5e300, 3.0, "", "x\ny", '"', "\\", "\x7f\x1f", [], [1, "a"],
              {}, {"a b": 1, "c": [1.5]}]  # fmt: skip
    for v in values:
        assert tomllib.loads(f"v = {toml_value(v)}")["v"] == v, v
    assert math.isinf(tomllib.loads(f"v = {toml_value(-math.inf)}")["v"])
    with pytest.raises(TypeError, match="no TOML form"):
        toml_value(None)


# ----------------------------------------------------------------------------- the CLI


def test_cli_show_prints_toml_and_notes_on_stderr():
    r = runner.invoke(app, ["config", "show", QUICKSTART, "--set", "strategy.name=summary"])
    assert r.exit_code == 0, r.output
    data = tomllib.loads(r.stdout)  # stdout is only the TOML
    assert (
        data["steps"] == 40 and data["strategy"]["name"] == "summary" and "max_turns" not in data["strategy"]
    )
    assert data["train"]["lr"] == 0.003 and data["engine"]["kv_pool_tokens"] == 65536
    assert "dropped strategy field(s) ['max_turns']" in r.stderr


def test_cli_show_defaults_need_a_kind():
    r = runner.invoke(app, ["config", "show", "--kind", "rollout"])
    assert r.exit_code == 0, r.output
    assert tomllib.loads(r.stdout)["episodes"] == 8
    r = runner.invoke(app, ["config", "show"])
    assert r.exit_code == 2 and "--kind" in said(r)


def test_cli_show_refuses_a_missing_file(tmp_path):
    r = runner.invoke(app, ["config", "show", str(tmp_path / "nope.toml")])
    assert r.exit_code == 2 and "does not exist" in said(r) and "Traceback" not in said(r)


def test_cli_show_refuses_an_ambiguous_config(tmp_path):
    f = tmp_path / "shared_fields_only.toml"
    f.write_text('mode = "full"\n[env]\nname = "rooms"\n')
    r = runner.invoke(app, ["config", "show", str(f)])
    assert r.exit_code == 2 and "--kind train or --kind rollout" in said(r)
    both = tmp_path / "both.toml"
    both.write_text("steps = 3\nepisodes = 2\n")
    r = runner.invoke(app, ["config", "show", str(both)])
    assert r.exit_code == 2 and "['steps']" in said(r) and "['episodes']" in said(r)
    ok = runner.invoke(app, ["config", "show", str(f), "--kind", "rollout"])  # --kind settles it
    assert ok.exit_code == 0 and tomllib.loads(ok.stdout)["mode"] == "full"


def test_cli_show_refuses_bad_input(tmp_path):
    r = runner.invoke(app, ["config", "show", "--kind", "eval"])
    assert r.exit_code == 2 and "train | rollout" in said(r)
    bad = tmp_path / "bad.toml"
    bad.write_text("steps = [\n")
    r = runner.invoke(app, ["config", "show", str(bad)])
    assert r.exit_code == 2 and "not valid TOML" in said(r)
    r = runner.invoke(app, ["config", "show", QUICKSTART, "--set", "stepz=3"])
    assert r.exit_code == 2 and "stepz" in said(r)
    r = runner.invoke(app, ["config", "show", QUICKSTART, "--kind", "rollout"])
    assert r.exit_code == 2 and "steps" in said(r)  # a train file read as a rollout config


def test_cli_reference_writes_and_checks(tmp_path):
    f = tmp_path / "config.md"
    r = runner.invoke(app, ["config", "reference", "--out", str(f)])
    assert r.exit_code == 0, r.output
    assert f.read_text(encoding="utf-8") == reference()
    assert runner.invoke(app, ["config", "reference", "--out", str(f), "--check"]).exit_code == 0
    f.write_text("stale\n")
    r = runner.invoke(app, ["config", "reference", "--out", str(f), "--check"])
    assert r.exit_code == 1 and "out of date" in said(r) and "config reference" in said(r)
    r = runner.invoke(app, ["config", "reference"])
    assert r.exit_code == 0 and r.stdout == reference()  # plain print: no rich markup mangling
