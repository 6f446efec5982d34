"""A fuzzer that keeps disttrain's input contract: for any input, exit 0, or one line and exit 2;
never a traceback; never a file outside the folder disttrain was given.

Property tests (hypothesis) over the CLI's argv, job specs, hostfiles and tarball member lists.
The CLI is driven in-process (``disttrain.cli.main.main``), so an example costs milliseconds;
``run`` and ``bench`` always get ``--dry-run`` and no ssh/Slurm flags, so nothing is started.
Examples per run are bounded (``EXAMPLES``) so that CI stays quick; raise them with
``DISTTRAIN_FUZZ_EXAMPLES=N`` for a longer hunt.
"""

from __future__ import annotations

import contextlib
import io
import os
import tarfile
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import SCRIPTS
from disttrain.cli.main import build_parser, main
from disttrain.config.hosts import MAX_SLOTS, SSH_DEFAULT_PORT, Host, parse_hostfile, parse_hosts
from disttrain.errors import UsageError
from disttrain.jobs.spec import KNOWN_KEYS, load_spec
from disttrain.jobs.tarballs import safe_extract

EXAMPLES = int(os.environ.get("DISTTRAIN_FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                            HealthCheck.too_slow])
GOOD = str(SCRIPTS / "ranks_report.py")

# Flags that reach ssh, Slurm or a copy to other hosts: their own tests use real rigs.
_STARTS_SOMETHING = {"--backend", "--nodes", "--partition", "--time", "--gpus-per-node", "--sbatch-arg", "--requeue",
                     "--no-wait", "--pending-timeout", "--hosts", "--hostfile", "--ssh-option", "--python", "--sync",
                     "--no-preflight", "--plot"}


def _flags(command: str) -> list[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.choices and command in a.choices)
    flags = [s for a in sub.choices[command]._actions for s in a.option_strings]
    return [f for f in flags if f not in _STARTS_SOMETHING and f not in ("-h", "--help")]


# Words an attacker or a typo would give: option-looking, empty, odd bytes, numbers at the edges.
_word = st.one_of(
    st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=12),
    st.sampled_from(["-", "--", "-V", "-oProxyCommand=x", "0", "-1", "99999999999999999999", "auto", "all", "1e9",
                     "nan", "a=b", "=x", "KEY", "..", "/", "/etc/passwd", "$(touch x)", GOOD, "all,0-", "0-1,",
                     "\udcff".encode("utf-8", "surrogatepass").decode("utf-8", "replace"), "static", "c10d",
                     "tensorflow", "gloo", "nccl"]),
    st.integers(-2**70, 2**70).map(str),
)


def _argv() -> st.SearchStrategy[list[str]]:
    run = st.tuples(st.just(["run", "--dry-run"]), st.lists(st.one_of(st.sampled_from(_flags("run")), _word),
                                                            max_size=8))
    bench = st.tuples(st.just(["bench", "--dry-run"]), st.lists(st.one_of(st.sampled_from(_flags("bench")), _word),
                                                                max_size=8))
    jobs = st.tuples(st.sampled_from([["jobs", a] for a in ("ls", "show", "logs", "stop")] + [["job", "run"]]),
                     st.lists(st.one_of(st.sampled_from(["-n", "--json", "--rank", "--limit", "--timeout"]),
                                        _word), max_size=4))
    anything = st.tuples(st.just([]), st.lists(_word, max_size=4))
    return st.one_of(run, bench, jobs, anything).map(lambda parts: [*parts[0], *parts[1]])


@contextlib.contextmanager
def _sandbox(monkeypatch):
    """A fresh working folder with DISTTRAIN_HOME and the store inside it; no outer job's env."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "work"
        work.mkdir()
        monkeypatch.setenv("DISTTRAIN_HOME", str(work / "home"))
        monkeypatch.setenv("DISTTRAIN_STORE", str(work / "home" / "jobs.db"))
        before = os.getcwd()
        os.chdir(work)
        try:
            yield work
        finally:
            os.chdir(before)  # before the folder goes: a deleted cwd breaks whatever runs next


def _call(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exit_:  # --help, --version: argparse's own exit
            code = exit_.code or 0
    return code, out.getvalue(), err.getvalue()


def _assert_contract(argv, code: int, out: str, err: str) -> None:
    assert "Traceback" not in out + err, (argv, err)
    if code == 0:
        return
    assert code == 2, (argv, code, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("disttrain: error: "), (argv, err)


@pytest.fixture(autouse=True)
def _no_outer_job(monkeypatch):
    for name in [k for k in os.environ if k.startswith(("SLURM_", "DISTTRAIN_"))]:
        monkeypatch.delenv(name)


@pytest.mark.timeout(300)
@FUZZ
@given(argv=_argv())
def test_cli_argv_exit_0_or_one_line_exit_2(monkeypatch, argv):
    with _sandbox(monkeypatch) as work:
        code, out, err = _call(argv)
        _assert_contract(argv, code, out, err)
        written = [p for p in work.rglob("*") if not p.is_relative_to(work / "home")]
        assert not written, (argv, written)  # --dry-run and refusals write nothing


_value = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True), _word),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(_word, inner, max_size=3)),
    max_leaves=8,
)


@pytest.mark.timeout(300)
@FUZZ
@given(fields=st.dictionaries(st.one_of(st.sampled_from(KNOWN_KEYS), _word), _value, max_size=8),
       raw=st.one_of(st.none(), st.binary(max_size=64)))
def test_job_spec_exit_0_or_one_line_exit_2(monkeypatch, fields, raw):
    import yaml

    with _sandbox(monkeypatch) as work:
        spec = work / "job.yaml"
        # Never a runnable job: the script is missing, so even a valid spec stops before it starts.
        fields = {**fields, "entry_point": "missing.py", "source_dir": str(work)} if raw is None else fields
        text = raw if raw is not None else yaml.safe_dump(fields, allow_unicode=True).encode("utf-8", "surrogatepass")
        spec.write_bytes(text)
        code, out, err = _call(["job", "run", str(spec)])
        _assert_contract(fields, code, out, err)
        assert code == 2  # nothing here can run
        assert not (work / "home").exists()  # nothing recorded, no job folder made
        try:
            checked = load_spec(spec)
        except UsageError:
            return
        assert isinstance(checked.to_record(), dict)


_host_line = st.one_of(
    st.builds(lambda user, name, port, opts: f"{user}{name}{port} {' '.join(opts)}",
              st.sampled_from(["", "root@", "-u@", "a b@"]),
              st.sampled_from(["node0", "NODE0", "node1", "-V", "-oProxyCommand=x", "[::1]", "10.0.0.1", "n\u0663", ""]),
              st.sampled_from(["", ":22", ":2222", ":0", ":65536", ":99999999999999999999", ":-1"]),
              st.lists(st.sampled_from(["slots=1", "slots=0", "slots=4096", "slots=4097", "slots=\u0663",
                                        "slots=99999999999999999999", "slots=", "x=1", "#c"]), max_size=3)),
    _word,
)


@pytest.mark.timeout(120)
@settings(max_examples=EXAMPLES * 2, deadline=None)
@given(lines=st.lists(_host_line, max_size=6), raw=st.one_of(st.none(), st.binary(max_size=48)))
def test_hostfile_parses_to_safe_hosts_or_one_line(lines, raw):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "hosts"
        path.write_bytes(raw if raw is not None else "\n".join(lines).encode("utf-8", "surrogatepass"))
        try:
            hosts = parse_hostfile(path)
        except UsageError as err:
            assert "\n" not in str(err)
            return
    _assert_safe_hosts(hosts)


@settings(max_examples=EXAMPLES * 2, deadline=None)
@given(words=st.lists(_host_line.map(lambda line: line.split(" ")[0]), max_size=5))
def test_hosts_flag_parses_to_safe_hosts_or_one_line(words):
    try:
        hosts = parse_hosts(",".join(words))
    except UsageError as err:
        assert "\n" not in str(err)
        return
    _assert_safe_hosts(hosts)


def _assert_safe_hosts(hosts: tuple[Host, ...]) -> None:
    keys = [(h.name.lower(), h.port or SSH_DEFAULT_PORT) for h in hosts]
    assert len(set(keys)) == len(keys)
    for host in hosts:
        assert not host.name.startswith("-") and not (host.user or "").startswith("-")
        assert host.slots is None or 1 <= host.slots <= MAX_SLOTS
        assert host.port is None or 1 <= host.port <= 65535


_component = st.sampled_from(["a", "b", "d1", "..", ".", "", "s", "l"])
_member = st.tuples(
    st.lists(_component, min_size=1, max_size=4).map("/".join),
    st.sampled_from(["file", "dir", "sym", "hard"]),
    st.one_of(st.lists(_component, min_size=1, max_size=5).map("/".join),
              st.sampled_from(["/", "/etc", "../../..", "a/../../..", "l/../..", ""])),
)


@pytest.mark.timeout(300)
@FUZZ
@given(members=st.lists(_member, min_size=1, max_size=7), leading_slash=st.booleans(),
       mtime=st.one_of(st.just(0), st.integers(-2**40, 8**11 - 1)), mode=st.integers(0, 0o7777))
def test_tarball_never_writes_outside_its_folder(members, leading_slash, mtime, mode):
    kinds = {"file": tarfile.REGTYPE, "dir": tarfile.DIRTYPE, "sym": tarfile.SYMTYPE, "hard": tarfile.LNKTYPE}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        archive = root / "t.tar"
        with tarfile.open(archive, "w") as tar:
            for index, (name, kind, link) in enumerate(members):
                info = tarfile.TarInfo(("/" if leading_slash and index == 0 else "") + name)
                info.type = kinds[kind]
                info.mtime, info.mode = mtime, mode | (0o700 if kind == "dir" else 0)
                if kind in ("sym", "hard"):
                    info.linkname = link
                    tar.addfile(info)
                elif kind == "file":
                    info.size = 1
                    tar.addfile(info, io.BytesIO(b"x"))
                else:
                    tar.addfile(info)
        dest = root / "a" / "b" / "c" / "d" / "e" / "job"
        try:
            safe_extract(archive, dest)
        except UsageError as err:
            assert "\n" not in str(err)
            assert not dest.exists()  # refused before anything was written
        outside = [p for p in root.rglob("*") if p != archive and not p.is_relative_to(dest)
                   and not (p.is_dir() and dest.is_relative_to(p))]
        assert not outside, (members, outside)
        for path in dest.rglob("*") if dest.exists() else ():
            assert Path(os.path.realpath(path)).is_relative_to(dest.resolve()) or not path.exists(), (members, path)


# --- every verb, every numeric option: huge, negative, empty (issue 46 point 4) ----------------------

# Numbers at and past every edge: 10^30 as an integer and as a float, negatives, empties, non-numbers.
_EDGES = ("1" + "0" * 30, "1e30", "-1", "-" + "9" * 30, "", "nan", "inf", "0", "4097", "65536")
# Options whose value is a number written in a string of its own form (parsed after argparse).
_NUMERIC_WORDS = {"--nnodes": ("{}", "1:{}"), "--nproc-per-node": ("{}",), "--nproc_per_node": ("{}",),
                  "--grad-compression": ("diloco:{}", "powersgd:{}", "localsgd:{}"), "--bucket-mb": ("{}",),
                  "--ranks": ("{}", "0-{}"), "--local-ranks-filter": ("{}",), "--nproc": ("{}", "1,{}"),
                  "--rdzv-endpoint": ("127.0.0.1:{}",)}
# Positionals and flags each verb needs to get as far as its options, never so far that it starts something.
_VERBS = {("run",): ["--dry-run", GOOD], ("bench",): ["--dry-run", GOOD], ("doctor",): ["--hosts", ""],
          ("job", "run"): ["missing.yaml"], ("jobs", "ls"): [], ("jobs", "show"): ["1"], ("jobs", "logs"): ["1"],
          ("jobs", "stop"): ["1"], ("jobs", "metrics"): ["1"], ("tune", "run"): [], ("tune", "ls"): [],
          ("tune", "show"): ["1"], ("tune", "stop"): ["1"], ("tune", "resume"): ["1"],
          # an address no interface here has (TEST-NET-3): a port in range is refused at the bind, no server starts
          ("ui",): ["--host", "203.0.113.1"]}
# Verbs that take an id: every id, huge ones included, is the job or exit 2.
_IDS = (("jobs", "show"), ("jobs", "logs"), ("jobs", "stop"), ("jobs", "metrics"), ("tune", "show"), ("tune", "stop"))


def _numeric_options(verb: tuple[str, ...]) -> list[str]:
    import argparse

    parser = build_parser()
    for word in verb:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[word]
    found = []
    for action in parser._actions:
        if not action.option_strings or action.nargs == 0 or set(action.option_strings) & _STARTS_SOMETHING:
            continue
        flag = next((f for f in action.option_strings if f.startswith("--") and "_" not in f),
                    action.option_strings[-1])
        if action.type in (int, float) or flag in _NUMERIC_WORDS:
            found.append(flag)
    return found


def test_every_verb_is_covered_by_the_numeric_sweep():
    import argparse

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    public = {name for name in sub.choices if name not in ("agent", "receive", "batch-step", "run-spec",
                                                           "launch-step", "sagemaker")}
    assert public <= {verb[0] for verb in _VERBS}, public - {verb[0] for verb in _VERBS}
    assert "--hang-timeout" in _numeric_options(("run",)) and "--limit" in _numeric_options(("jobs", "ls"))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("verb", list(_VERBS), ids=" ".join)
def test_every_numeric_option_huge_negative_or_empty_is_0_or_one_line_exit_2(monkeypatch, verb):
    cases = []
    for flag in _numeric_options(verb):
        for form in _NUMERIC_WORDS.get(flag, ("{}",)):
            cases += [[flag, form.format(edge)] for edge in _EDGES]
    if verb in _IDS:
        cases += [[edge] for edge in (*_EDGES, "99999999999999999999", str(2**63), str(2**63 - 1), "\u0663")]
    cases = cases or [[]]  # a verb with no number of its own: its plain call keeps the contract too
    with _sandbox(monkeypatch):
        for extra in cases:
            argv = [*verb, *extra, *(_VERBS[verb] if verb not in _IDS or extra[0].startswith("-") else [])]
            code, out, err = _call(argv)
            _assert_contract(argv, code, out, err)


def test_huge_numbers_name_their_range(monkeypatch):
    """The cases of the issue: each answered in one line that names the range."""
    huge = "100000000000000000000"
    with _sandbox(monkeypatch):
        for argv, said in (
                (["run", "--dry-run", "-n", huge, GOOD], "-n/--nproc-per-node must be in 1..4096"),
                (["run", "--dry-run", "--hang-timeout", huge, GOOD], "--hang-timeout must be in 0..1000000 seconds"),
                (["run", "--dry-run", "--grad-compression", f"diloco:{huge}", GOOD], "must be in 1..1000000000"),
                (["run", "--dry-run", "--nnodes", f"1:{huge}", "--rdzv-backend", "c10d", GOOD], "must be in 1..65536"),
                (["jobs", "ls", "--limit", "-1"], "--limit must be in 0..2147483647, got -1"),
                (["jobs", "show", "99999999999999999999"], "no job '99999999999999999999'")):
            code, _out, err = _call(argv)
            assert code == 2 and said in err and err.count("\n") == 1, (argv, err)
