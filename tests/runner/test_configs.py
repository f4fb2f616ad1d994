"""Every config combination composes with Hydra and validates; bad ones fail before any load."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from kvnotes.models import get_spec, model_names
from runner import jobs as registry
from runner.config import KINDS, ConfigError, validate
from runner.main import prepare
from runner.task_config import SCHEMAS, GatedTask, MemoryTask, SkillsTask

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
COMPOSE_ERRORS = (HydraException, OmegaConfBaseException)


@pytest.fixture(scope="module", autouse=True)
def hydra_ready():
    """Registry filled, schemas stored, Hydra initialised on configs/ for this module."""
    prepare()
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        yield


def jobs() -> list[tuple[str, str]]:
    prepare()
    return [(kind, name) for kind in KINDS for name in registry.names(kind)]


def make(*overrides: str):
    return compose("config", overrides=list(overrides))


def test_every_registered_model_has_a_matching_config():
    files = {p.stem for p in (CONFIGS / "model").glob("*.yaml")}
    assert files == set(model_names())
    for name in model_names():
        data = yaml.safe_load((CONFIGS / "model" / f"{name}.yaml").read_text())
        spec = get_spec(name)
        assert (data["name"], data["dtype"], data["chat"]) == (name, spec.default_dtype, spec.chat)
        assert data["margin"] is None  # the number lives in kvnotes.measure.margins only


def test_the_margin_has_one_source_on_every_path():
    """Registered and tiny models alike: the run config, the loaded model (what probes read) and
    the context (what experiments read) carry the same margin; an override reaches all of them."""
    from kvnotes.measure import margins
    from probes.parts.common import resolve_margin
    from runner.context import load

    job = validate(make("+experiment=selfcheck"))
    assert job.cfg.model.margin == margins.margin_of("llama") == get_spec("llama").margin
    for extra in ([], ["model.margin=0.5"]):
        job = validate(make("+experiment=selfcheck", "model.name=tiny-llama", "model.tiny_family=llama", *extra))
        model = load(job.cfg)
        want = 0.5 if extra else margins.HAND_MARGIN
        assert job.cfg.model.margin == model.margin == resolve_margin(model, None) == want


def test_job_yamls_list_their_schema_first():
    assert ("experiment", "selfcheck") in jobs()
    for kind in KINDS:
        for path in (CONFIGS / kind).glob("*.yaml"):
            defaults = yaml.safe_load(path.read_text()).get("defaults", [])
            assert defaults[:1] == [f"/schema/{kind}/{path.stem}@_here_"], path
            assert path.stem in registry.names(kind), f"{path} names no registered {kind}"


@pytest.mark.parametrize("model", model_names())
def test_every_model_composes_with_every_job(model):
    for kind, name in jobs():
        job = validate(make(f"+{kind}={name}", f"model={model}"))
        assert (job.kind, job.name, job.cfg.model.name) == (kind, name, model)
        entry = registry.get(kind, name)
        if entry.config_cls is not None:
            assert isinstance(job.params, entry.config_cls)


def test_every_job_refuses_a_misspelt_key():
    for kind, name in jobs():
        if registry.get(kind, name).config_cls is not None:
            with pytest.raises(COMPOSE_ERRORS):
                make(f"+{kind}={name}", f"{kind}.no_such_key=1")


def test_defaults():
    job = validate(make("+experiment=selfcheck"))
    cfg = job.cfg
    assert cfg.model.name == "llama"
    assert (cfg.device, cfg.dtype, cfg.seed, cfg.resume) == ("auto", "auto", 0, True)
    assert cfg.results_dir == "results/runs" and cfg.cache_dir is None
    assert isinstance(cfg.task, GatedTask) and cfg.task.name == "gated"  # the default suite, typed
    assert cfg.task.build_kwargs()["suite"] == "gated" and cfg.task.template_dirs == []
    assert job.params.seams == [0, 1, 2, 4, 8, 16]


def test_hydra_writes_nothing_into_the_working_directory():
    hydra_cfg = compose("config", overrides=["+experiment=selfcheck"], return_hydra_config=True)
    assert hydra_cfg.hydra.output_subdir is None
    assert hydra_cfg.hydra.run.dir == "."
    assert hydra_cfg.hydra.job.chdir is False


@pytest.mark.parametrize(
    "override",
    ["sed=1", "model.nmae=llama", "experiment.n_blokcs=2"],
)
def test_misspelt_key_fails_at_composition(override):
    with pytest.raises(COMPOSE_ERRORS, match="override"):
        make("+experiment=selfcheck", override)


@pytest.mark.parametrize(
    "override",
    ["seed=abc", "resume=maybe", "model.margin=wide", "experiment.n_blocks=two",
     "experiment.seams=[a,b]"],
)
def test_wrong_type_fails_at_composition(override):
    with pytest.raises(COMPOSE_ERRORS):
        make("+experiment=selfcheck", override)


def test_typed_merge_also_catches_keys_added_with_plus():
    cfg = make("+experiment=selfcheck")
    bad = OmegaConf.merge(OmegaConf.to_container(cfg), {"experiment": {"n_blokcs": 3}})
    with pytest.raises(ConfigError, match="n_blokcs"):
        validate(OmegaConf.create(bad))


def test_unknown_model_lists_valid_names():
    with pytest.raises(ConfigError, match="valid names: .*llama.*qwen3-8b"):
        validate(make("+experiment=selfcheck", "model.name=llama-9000"))
    with pytest.raises(COMPOSE_ERRORS, match="model/llama-9000"):
        make("model=llama-9000")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("device=gpu", "valid: auto, cpu, cuda"),
        ("device=cuda:x", "valid: auto, cpu, cuda"),
        ("dtype=float8", "valid: auto, float32"),
        ("model.dtype=int4", "valid: auto, float32"),
        ("model.margin=-1", "margin"),
        ("experiment.seams=[]", "seams"),
        ("experiment.threshold=2.0", "threshold"),
        ("experiment.n_blocks=0", "n_blocks"),
        ("model.tiny_family=bert", "valid families"),
        ("model.tiny_family=llama", "tiny-llama"),
    ],
)
def test_bad_values_fail_validation(override, message):
    with pytest.raises(ConfigError, match=message):
        validate(make("+experiment=selfcheck", override))


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:1"])
def test_valid_devices(device):
    assert validate(make("+experiment=selfcheck", f"device={device}")).cfg.device == device


def test_tiny_model_hook_validates():
    job = validate(make("+experiment=selfcheck", "model.name=tiny-qwen3", "model.tiny_family=qwen3"))
    assert job.cfg.model.tiny_family == "qwen3"


def test_no_job_lists_valid_probes_and_experiments():
    with pytest.raises(ConfigError, match="valid probes: .*valid experiments: .*selfcheck"):
        validate(make())


def test_unknown_job_name_fails():
    with pytest.raises(COMPOSE_ERRORS, match="experiment/nope"):
        make("+experiment=nope")
    cfg = make("+experiment=selfcheck")
    cfg.experiment.name = "nope"
    with pytest.raises(ConfigError, match="valid experiments: .*selfcheck"):
        validate(cfg)


def test_task_group_is_optional_and_selectable():
    assert make("+experiment=selfcheck", "~task").task is None
    suites = sorted(p.stem for p in (CONFIGS / "task").glob("*.yaml"))
    if not suites:
        with pytest.raises(COMPOSE_ERRORS, match="task/"):
            make("+experiment=selfcheck", "task=nonexistent")
    for suite in suites:
        assert make("+experiment=selfcheck", f"task={suite}").task is not None


# --- the typed task group ---------------------------------------------------------------------

TINY = ["model.name=tiny-llama", "model.tiny_family=llama"]


def test_every_task_yaml_lists_its_kind_schema_first():
    for path in (CONFIGS / "task").glob("*.yaml"):
        defaults = yaml.safe_load(path.read_text()).get("defaults", [])
        assert defaults[:1] and defaults[0].startswith("/schema/task/"), path
        kind = defaults[0].removeprefix("/schema/task/").removesuffix("@_here_")
        assert kind in SCHEMAS, path


@pytest.mark.parametrize(("suite", "cls"), [("gated", GatedTask), ("gated-trigger", GatedTask),
                                            ("skills", SkillsTask), ("memory", MemoryTask)])
def test_each_suite_kind_gets_its_dataclass(suite, cls):
    job = validate(make("+experiment=selfcheck", f"task={suite}"))
    assert type(job.cfg.task) is cls and job.cfg.task.name == suite


@pytest.mark.parametrize("override", ["task.n_items=abc", "task.nitems=4", "task.length=long",
                                      "task.design.fewshot=two", "task.design.nope=1"])
def test_task_misspelt_key_or_wrong_type_fails_at_composition(override):
    with pytest.raises(COMPOSE_ERRORS):
        make("+experiment=selfcheck", override)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("task.n_items=-3", "task.n_items must be >= 1, got -3"),
        ("+task.nitems=4", "task.nitems: Key 'nitems' not in 'GatedTask'"),
        ("task.length=0", "task.length must be >= 1"),
        ("task.seed=-1", "task.seed must be >= 0"),
        ("task.name=gatd", "valid suites: .*gated"),
        ("task.name=memory", "is a memory suite, but task is typed as gated: use task=memory"),
        ("task.name=agents", "agent scenarios are built by \\+experiment=agent"),
        ("task.domains=[refund,nope]", "task.domains: \\['nope'\\] not in suite 'gated'; valid: access"),
        ("task.design.fewshot=3", "fewshot must be an even number"),
        ("task.design.rule_position=top", "rule_position 'top'"),
        ("task.kind=memory", "task.kind is fixed to 'gated'"),
        ("task.template_dirs=[/no/such/dir]", "template_dirs: '/no/such/dir' is not a directory"),
    ],
)
def test_bad_task_values_fail_validation(override, message):
    with pytest.raises(ConfigError, match=message):
        validate(make("+experiment=selfcheck", *TINY, override))


def test_trigger_suite_refuses_demonstrations():
    with pytest.raises(ConfigError, match="fewshot must be 0 for a trigger suite"):
        validate(make("+experiment=selfcheck", "task=gated-trigger", "task.design.fewshot=2"))


def test_plus_key_on_a_typed_job_node_is_refused_too():
    with pytest.raises(ConfigError, match="experiment.n_blokcs: Key 'n_blokcs' not in 'SelfcheckConfig'"):
        validate(make("+experiment=selfcheck", "+experiment.n_blokcs=3"))


def test_template_dirs_is_a_task_key(tmp_path):
    (tmp_path / "library.yaml").write_text(
        "kind: gated\ndomains: []\nextra_domains:\n  library:\n    role: a library assistant\n"
        "    field: card_status\n    values: [valid, blocked]\n    outcomes: [lend_book, ask_librarian]\n"
        "    requests: [I would like to borrow this book.]\n"
    )
    job = validate(make("+experiment=selfcheck", f"task.template_dirs=[{tmp_path}]", "task.name=library"))
    kwargs = job.cfg.task.build_kwargs()
    assert kwargs["suite"] == "library" and kwargs["template_dirs"] == [str(tmp_path)]


def test_task_length_is_bounded_by_the_model_positions(tmp_path):
    """The bound comes from config.json in the cache (no weights loaded)."""
    folder = tmp_path / "models" / "llama"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({
        "max_position_embeddings": 8192, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "hidden_size": 576}))
    cfg = make("+experiment=selfcheck", "model=llama", f"cache_dir={tmp_path}", "task.length=10000000")
    with pytest.raises(ConfigError, match="task.length=10000000 exceeds the 8192 positions of model llama"):
        validate(cfg)
    ok = validate(make("+experiment=selfcheck", "model=llama", f"cache_dir={tmp_path}", "task.length=8192",
                       "task.n_items=1"))
    assert ok.cfg.task.length == 8192


@pytest.mark.parametrize(("overrides", "message"), [
    (["+experiment=compose_scaling", "experiment.lengths=[512,16384]"],
     "experiment.lengths=16384 plus 128 tokens around it exceeds the 8192 positions of model llama"),
    (["+experiment=compose_scaling", "experiment.lengths=[8192]"], "use experiment.lengths <= 8064"),
    (["+experiment=compose", "experiment.length=9000"], "experiment.length=9000 exceeds the 8192 positions"),
    (["+experiment=memory", "experiment.length=8190"], "experiment.length=8190 plus 12 tokens around it"),
    (["+experiment=memory", "experiment.locomo_path=x.json", "experiment.locomo_max_tokens=8000"],
     "experiment.locomo_max_tokens=8000 plus 268 tokens"),
    (["+experiment=serving", "experiment.length=8100", "experiment.max_model_len=9000"],
     "experiment.length=8100 plus 128 tokens"),
    (["+experiment=blend", "experiment.locomo_blocks=30"], "experiment.locomo_blocks x locomo_block_tokens=9000"),
])
def test_an_experiments_own_prompt_length_is_bounded_by_the_model_positions(tmp_path, overrides, message):
    """Experiments that set their own prompt lengths are refused before any weights load when the
    longest prompt, with the tokens around it, does not fit the model's positions."""
    folder = tmp_path / "models" / "llama"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({
        "max_position_embeddings": 8192, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "hidden_size": 576}))
    with pytest.raises(ConfigError, match=message):
        validate(make(*overrides, "model=llama", f"cache_dir={tmp_path}"))
    default = overrides[0]
    assert validate(make(default, "model=llama", f"cache_dir={tmp_path}")).name  # the defaults fit


def test_task_length_is_bounded_by_a_memory_estimate():
    """A tiny random model has no position bound; the memory estimate still refuses 10M tokens."""
    with pytest.raises(ConfigError, match="task.length=10000000 with task.n_items=48 needs about .* of memory"):
        validate(make("+experiment=selfcheck", *TINY, "task.length=10000000"))
    assert validate(make("+experiment=selfcheck", *TINY, "task.length=8000")).cfg.task.length == 8000


def test_results_dir_that_is_a_file_fails_validation(tmp_path):
    (tmp_path / "results").write_text("")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        validate(make("+experiment=selfcheck", *TINY, f"results_dir={tmp_path / 'results'}"))
    with pytest.raises(ConfigError, match="which is a file"):
        validate(make("+experiment=selfcheck", *TINY, f"results_dir={tmp_path / 'results' / 'runs'}"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_unwritable_results_dir_fails_validation(tmp_path):
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(ConfigError, match="no permission to write"):
            validate(make("+experiment=selfcheck", *TINY, f"results_dir={tmp_path / 'runs'}"))
    finally:
        tmp_path.chmod(0o700)
