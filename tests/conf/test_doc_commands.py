"""The commands the documentation shows exist as written: every ``python -m framework.run`` line
composes (each job of a sweep line too) into a config the run accepts, and every ``--option``
given to a script is one the script defines. Catches a doc left behind by a renamed config key,
group option or flag."""
import itertools
import re
import shlex
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from framework.harness.experiment import check_workload, engine_config
from framework.harness.workload import create_workload
from tests.hydra_support import compose_config

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "experiments" / "README.md", *sorted((ROOT / "docs").glob("*.md")),
        *(ROOT / "framework" / f"{m}.py" for m in ("run", "compare", "profile", "harness/run", "harness/compare", "sim/profile")),
        *sorted((ROOT / "conf").rglob("*.yaml")), *sorted((ROOT / "experiments").glob("*.py"))]
#: Placeholders a reader fills in; a command holding one is a pattern, not a command.
PLACEHOLDER = re.compile(r"\bNAME\b|\bKEY\b|\bVALUE\b|\bDATE\b|\.\.\.|\[")
#: Plugins the docs install first (tests/policies/test_plugin.py and tests/test_writing_a_part.py run those commands).
PLUGINS = ("srpt", "padded_sdpa", "no_cache", "rebuild")
RUN = re.compile(r"(?:python -m framework\.run|servelab-run|make run ARGS=\")([^`#\n\"]*)")
#: What a command line's arguments look like (anything else after the name is prose about it).
ARG = re.compile(r"-m|--multirun|~[\w.]+|[+~]?[\w./@-]+=\S*")
SCRIPT = re.compile(r"python (?:-m )?(framework[./]profile|framework[./]compare|experiments[./]\w+)(?:\.py)?([^`#\n]*)")


def doc_lines():
    for path in DOCS:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            yield f"{path.relative_to(ROOT)}:{number}", line


def run_commands():
    seen = set()
    for where, line in doc_lines():
        for match in RUN.finditer(line):
            args = match.group(1).strip().rstrip("`'").strip()
            if PLACEHOLDER.search(args) or any(p in args for p in PLUGINS):
                continue
            if not all(ARG.fullmatch(t) for t in shlex.split(args)):
                continue  # prose: "``python -m framework.run`` exits with status 1"
            if args in seen:
                continue
            seen.add(args)
            yield pytest.param(args, id=f"{where}: {args}"[:120])


def sweep_jobs(args):
    """The override lists of the jobs ``python -m framework.run ARGS`` runs (one unless ``-m``)."""
    tokens = [t.replace("{out}", "/tmp/out") for t in shlex.split(args) if t not in ("-m", "--multirun")]
    sweep = "-m" in shlex.split(args) or "--multirun" in shlex.split(args)
    axes = []
    for token in tokens:
        key, _, value = token.partition("=")
        plain = not any(c in value for c in "[]{}'\"")
        values = value.split(",") if sweep and plain and "," in value else [value]
        axes.append([f"{key}={v}" for v in values])
    return [list(job) for job in itertools.product(*axes)]


@pytest.mark.parametrize("args", list(run_commands()))
def test_every_documented_run_command_composes(args):
    for overrides in sweep_jobs(args):
        hydra_args = [o for o in overrides if o.startswith("hydra")]
        cfg = compose_config(*(o for o in overrides if o not in hydra_args))
        config = engine_config(cfg)  # the values are ones the run accepts, not only keys the config has
        workload, _ = create_workload(OmegaConf.to_container(cfg.workload, resolve=True))
        check_workload(config, workload)  # and an engine of them can serve the workload's lengths
        if hydra_args:
            compose_config(*overrides, return_hydra_config=True)


#: Where the ``python -m framework.NAME`` commands are written (their entry modules are thin).
COMMAND_SOURCES = {"framework/run": "framework/harness/run", "framework/compare": "framework/harness/compare",
                   "framework/profile": "framework/sim/profile"}


def script_commands():
    for where, line in doc_lines():
        for match in SCRIPT.finditer(line):
            script = match.group(1).replace(".", "/")
            options = re.findall(r"(?<![\w-])(--[a-z][\w-]*)", match.group(2).split(" -- ")[0])
            if options:
                yield pytest.param(script, options, id=f"{where}: {script} {' '.join(options)}"[:120])


@pytest.mark.parametrize("script, options", list(script_commands()))
def test_every_documented_script_option_exists(script, options):
    source = (ROOT / f"{COMMAND_SOURCES.get(script, script)}.py").read_text()
    for option in options:
        assert f'"{option}"' in source, f"{script}.py has no {option} option"


def test_the_docs_show_commands():
    """The patterns above still find what they check (a change of wording would leave them idle)."""
    assert len(list(run_commands())) >= 20 and len(list(script_commands())) >= 10


def test_every_named_experiment_is_documented_as_what_it_is():
    """experiments/README.md names every file of conf/experiment/, and says of one that runs a
    single job that it does (its section used to say that each launches a sweep)."""
    readme = (ROOT / "experiments" / "README.md").read_text()
    section = readme[readme.index("## Named experiments"):]
    for path in sorted((ROOT / "conf" / "experiment").glob("*.yaml")):
        mention = re.search(rf"`{path.stem}`[^\n]*", section)
        assert mention, f"experiments/README.md does not name +experiment={path.stem}"
        cfg = compose_config(f"+experiment={path.stem}", return_hydra_config=True)
        if cfg.hydra.mode is None or cfg.hydra.mode.name != "MULTIRUN":
            assert "one run" in mention.group(0), f"+experiment={path.stem} is one run, not a sweep"
