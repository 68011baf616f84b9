"""Specification of the code-search readers (small files in each real format), the download tools of
data_scripts/fetch.py, and the data scripts: the stdlib stand-in builder and the real-data
downloader."""

import http.server
import importlib.util
import json
import subprocess
import sys
import textwrap
import threading
import zipfile
from collections import Counter
from pathlib import Path

import pytest
import torch
from fetch import SUMS, DownloadError, download, recorded_sums, sha256sum

from gcbs_lib.data import data_root
from gcbs_lib.data.codesearch import load, retrieval_task

SCRIPTS = Path(__file__).resolve().parents[1] / "data_scripts"


def script(name):
    """Import data_scripts/<name>.py as a module."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


builder = script("build_codesearch_standin")


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


COSQA = [  # CosQA: a JSON list; token fields are space-joined strings; the query is `doc`
    {
        "idx": "cosqa-train-0",
        "doc": "python  read a  file",
        "code": "def f(p):\n    return open(p).read()",
        "code_tokens": "def f ( p ) :  return open ( p ) . read ( )",
        "docstring_tokens": "python read a file",
        "label": 0,
        "retrieval_idx": 7,
    },
    {
        "idx": "cosqa-train-1",
        "doc": "sort a list",
        "code": "def g(x):\n    return sorted(x)",
        "code_tokens": "def g ( x ) : return sorted ( x )",
        "docstring_tokens": "sort a list",
        "label": 1,
        "retrieval_idx": 3,
    },
]
CODE_IDX_MAP = {
    "def f(p):\n    return open(p).read()": 7,
    "def g(x):\n    return sorted(x)": 3,
    "def h():\n    pass": 11,
}
CSN = [  # CodeSearchNet / AdvTest train: token lists, `url` is the key
    {
        "repo": "a/b",
        "path": "m.py",
        "func_name": "f",
        "code_tokens": ["def", "f", "(", ")", ":", "pass"],
        "docstring_tokens": ["Do", "nothing", "."],
        "url": "https://github.com/a/b/blob/x/m.py#L1-L2",
    },
    {
        "repo": "a/b",
        "path": "m.py",
        "func_name": "g",
        "code_tokens": ["def", "g", "(", "x", ")", ":", "return", "x"],
        "docstring_tokens": ["Return", "x", "."],
        "url": "https://github.com/a/b/blob/x/m.py#L4-L5",
    },
]
ADVTEST_TEST = [  # AdvTest valid/test: `function_tokens` in place of `code_tokens`
    {
        "url": "u0",
        "function": "def func(arg_0): return arg_0",
        "docstring_tokens": ["Identity", "of", "x"],
        "function_tokens": ["def", "func", "(", "arg_0", ")", ":", "return", "arg_0"],
        "idx": 0,
    },
    {
        "url": "u1",
        "function": "def func(): pass",
        "docstring_tokens": ["Nothing", "at", "all"],
        "function_tokens": ["def", "func", "(", ")", ":", "pass"],
        "idx": 1,
    },
]


def test_data_root_follows_the_environment_variable(monkeypatch, tmp_path):
    monkeypatch.setenv("GCBS_DATA_ROOT", str(tmp_path))
    assert data_root() == tmp_path
    monkeypatch.delenv("GCBS_DATA_ROOT")
    assert data_root().name == "data" and (data_root().parent / "gcbs_lib").is_dir()


def test_download_fetches_once_and_enforces_a_known_checksum(tmp_path):
    source = tmp_path / "source.txt"
    source.write_text("payload")
    target = download(source.as_uri(), tmp_path / "a" / "copy.txt", sha256sum(source))
    assert target.read_text() == "payload" and not (tmp_path / "a" / "copy.txt.part").exists()
    source.write_text("changed")  # already there: not fetched again
    assert download(source.as_uri(), target).read_text() == "payload"
    with pytest.raises(ValueError, match="differs"):
        download(source.as_uri(), tmp_path / "b.txt", sha256="0" * 64)
    assert not (tmp_path / "b.txt").exists()


def test_without_a_known_checksum_the_first_fetch_records_one_that_later_runs_and_sha256sum_enforce(
    tmp_path,
):
    source, folder = tmp_path / "source.txt", tmp_path / "data"
    source.write_text("payload")
    target = download(source.as_uri(), folder / "copy.txt")
    assert recorded_sums(folder) == {"copy.txt": sha256sum(source)}
    assert subprocess.run(["sha256sum", "--check", "--quiet", SUMS], cwd=folder).returncode == 0
    # checked against the record: the same
    assert download(source.as_uri(), target).read_text() == "payload"
    assert recorded_sums(folder) == {"copy.txt": sha256sum(source)}  # and not recorded twice
    # on disk since the first fetch
    target.write_text("corrupted")
    with pytest.raises(ValueError, match=f"differs from the one in {folder / SUMS}"):
        download(source.as_uri(), target)
    assert not target.exists()


def test_download_says_clearly_when_a_host_is_unreachable(tmp_path):
    with pytest.raises(DownloadError, match="place it at"):
        download((tmp_path / "absent").as_uri(), tmp_path / "x")
    with pytest.raises(DownloadError, match="could not download http://127.0.0.1:9/"):
        download("http://127.0.0.1:9/file", tmp_path / "x", timeout=5)


class _CutConnection(http.server.BaseHTTPRequestHandler):
    """Promises 1,000 bytes, sends 10, then closes the connection."""

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "1000")
        self.end_headers()
        self.wfile.write(b"0123456789")

    def log_message(self, *args):
        pass


def test_a_download_cut_midway_is_a_clear_error_and_leaves_no_file(tmp_path):
    server = http.server.HTTPServer(("127.0.0.1", 0), _CutConnection)
    threading.Thread(target=server.handle_request, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}/file.zip"
    with pytest.raises(DownloadError, match="could not download .*IncompleteRead|truncated"):
        download(url, tmp_path / "file.zip", timeout=10)
    server.server_close()
    assert list(tmp_path.iterdir()) == []


def test_load_reads_a_cosqa_json_list_with_retrieval_idx_keys(tmp_path):
    path = tmp_path / "cosqa-retrieval-train-19604.json"
    path.write_text(json.dumps(COSQA))
    assert load(path) == [
        {
            "query": "python read a file",
            "code": "def f ( p ) : return open ( p ) . read ( )",
            "key": "7",
        },
        {"query": "sort a list", "code": "def g ( x ) : return sorted ( x )", "key": "3"},
    ]


def test_load_reads_code_idx_map_with_empty_queries(tmp_path):
    path = tmp_path / "code_idx_map.txt"
    path.write_text(json.dumps(CODE_IDX_MAP))
    assert load(path) == [
        {"query": "", "code": "def f(p): return open(p).read()", "key": "7"},
        {"query": "", "code": "def g(x): return sorted(x)", "key": "3"},
        {"query": "", "code": "def h(): pass", "key": "11"},
    ]


def test_load_reads_codesearchnet_jsonl_and_its_codebase(tmp_path):
    for name in ("train.jsonl", "codebase.jsonl"):
        assert load(write_jsonl(tmp_path / name, CSN)) == [
            {"query": "Do nothing .", "code": "def f ( ) : pass", "key": CSN[0]["url"]},
            {"query": "Return x .", "code": "def g ( x ) : return x", "key": CSN[1]["url"]},
        ]


def test_load_reads_advtest_function_tokens_in_place_of_code_tokens(tmp_path):
    rows = [{**row, "code_tokens": ["not", "used"]} for row in ADVTEST_TEST]
    examples = load(write_jsonl(tmp_path / "test.jsonl", rows))
    assert [e["code"] for e in examples] == [
        "def func ( arg_0 ) : return arg_0",
        "def func ( ) : pass",
    ]
    assert [e["key"] for e in examples] == ["u0", "u1"]


@pytest.mark.parametrize(
    "content, name, error, message",
    [
        (
            '{"url": "u", "docstring_tokens": ["a"]}\n',
            "x.jsonl",
            ValueError,
            "code_tokens or function_tokens",
        ),
        ('{"url": "u", "code_tokens": ["a"]}\n', "x.jsonl", ValueError, "docstring_tokens or doc"),
        (
            '{"code_tokens": ["a"], "docstring_tokens": ["a"]}\n',
            "x.jsonl",
            ValueError,
            "url or retrieval_idx",
        ),
        (
            '{"url": "u", "code_tokens": [], "docstring_tokens": []}\n{broken\n',
            "x.jsonl",
            ValueError,
            r"x.jsonl:2",
        ),
        (
            '{"url": "u"}\n{"url": "v"}\n',
            "x.json",
            ValueError,
            r"x.json is not valid JSON .*named \*.jsonl",
        ),
        ('"just a string"', "x.json", ValueError, "JSON list or object"),
        (
            '{"doc": "q", "code": "c", "retrieval_idx": 1}',
            "x.json",
            ValueError,
            "integer retrieval_idx",
        ),
        ("\n", "x.jsonl", ValueError, "no code-search examples"),
        ("[]", "x.json", ValueError, "no code-search examples"),
    ],
)
def test_load_refuses_malformed_files_naming_the_place(tmp_path, content, name, error, message):
    (tmp_path / name).write_text(content)
    with pytest.raises(error, match=message):
        load(tmp_path / name)


def test_load_refuses_a_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no code-search file"):
        load(tmp_path / "absent.jsonl")


def test_retrieval_task_pairs_cosqa_queries_with_code_idx_map(tmp_path):
    (tmp_path / "q.json").write_text(json.dumps(COSQA))
    (tmp_path / "code_idx_map.txt").write_text(json.dumps(CODE_IDX_MAP))
    task = retrieval_task(tmp_path / "q.json", tmp_path / "code_idx_map.txt")
    assert task.queries == ["python read a file", "sort a list"]
    assert (
        len(task.codes) == 3
        and task.positive.tolist() == [0, 1]
        and task.positive.dtype == torch.long
    )


def test_retrieval_task_pairs_codesearchnet_queries_with_the_codebase(tmp_path):
    write_jsonl(tmp_path / "codebase.jsonl", [CSN[1], {**CSN[0], "url": "other"}, CSN[0]])
    task = retrieval_task(write_jsonl(tmp_path / "test.jsonl", CSN), tmp_path / "codebase.jsonl")
    assert task.positive.tolist() == [2, 0]


def test_retrieval_task_uses_the_split_itself_as_advtest_pool(tmp_path):
    task = retrieval_task(write_jsonl(tmp_path / "test.jsonl", ADVTEST_TEST))
    assert task.positive.tolist() == [0, 1] and task.codes[1] == "def func ( ) : pass"


def test_retrieval_task_scores_unmatched_queries_minus_one_and_keeps_the_first_of_repeated_keys(
    tmp_path,
):
    queries = write_jsonl(tmp_path / "test.jsonl", CSN)
    task = retrieval_task(queries, write_jsonl(tmp_path / "codebase.jsonl", CSN[:1]))
    assert task.positive.tolist() == [0, -1] and (task.missing, task.repeated) == (1, 0)
    pool = [CSN[0], CSN[1], {**CSN[0], "code_tokens": ["x"]}]  # CSN[0]'s key again
    task = retrieval_task(queries, write_jsonl(tmp_path / "codebase.jsonl", pool))
    assert (
        task.positive.tolist() == [0, 1]
        and (task.missing, task.repeated) == (0, 1)
        and len(task.codes) == 2
    )
    assert task.codes[0] != "x"


# -------------------------------------------------------------------------------------------
# stand-in builder

PLANTED_LIBRARY = {  # module file -> source; the comments say what the extraction must do
    "geometry/__init__.py": '''
        def area(self, width, *, height=1):
            """Area of a rectangle.

            Second paragraph, not part of the query.
            """
            # a comment stays in the code, not in the tokens
            return self.width * width * height

        def undocumented(x):
            return x

        def short(x):
            """Too short."""
            return x

        def abstract(x):
            """Only a docstring and pass."""
            pass

        def one_line(x): """Docstring on the def line."""; return x

        class Shape:
            def grow(self, factor):
                """Grow the shape by a factor."""
                self.size *= factor
                return self
    ''',
    "geometry/copy.py": '''
        def area(self, width, *, height=1):
            """The same code as geometry.area: a duplicate, dropped."""
            # a comment stays in the code, not in the tokens
            return self.width * width * height
    ''',
    "strings.py": '''
        def shout(text,
                  times=1):
            """Return the text in capitals."""
            return text.upper() * times

        def whisper(text):
            """Return the text in capitals."""
            return text.lower()
    ''',
    "numbers.py": '''
        def double(n):
            """Return twice the number."""
            return 2 * n
    ''',
    "tests/test_numbers.py": '''
        def test_double():
            """Skipped: a test folder."""
            assert True
    ''',
}


@pytest.fixture
def planted_library(tmp_path):
    for name, source in PLANTED_LIBRARY.items():
        (tmp_path / "lib" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "lib" / name).write_text(textwrap.dedent(source))
    (tmp_path / "lib" / "broken.py").write_text("def (:\n")
    return tmp_path / "lib"


def test_extraction_pairs_first_docstring_paragraph_with_code_without_docstring(planted_library):
    pairs, skipped = builder.extract_stdlib_pairs(planted_library)
    assert skipped == ["broken.py: SyntaxError"]
    by_name = {(p["path"], p["func_name"]): p for p in pairs}
    assert sorted(by_name) == [
        ("geometry/__init__.py", "Shape.grow"),
        ("geometry/__init__.py", "area"),
        ("numbers.py", "double"),
        ("strings.py", "shout"),
        ("strings.py", "whisper"),
    ]
    area = by_name["geometry/__init__.py", "area"]
    assert area["docstring"] == "Area of a rectangle."
    assert area["docstring_tokens"] == ["Area", "of", "a", "rectangle", "."]
    assert area["code"] == (
        "def area(self, width, *, height=1):\n"
        "    # a comment stays in the code, not in the tokens\n"
        "    return self.width * width * height\n"
    )
    assert area["code_tokens"] == [
        "def",
        "area",
        "(",
        "self",
        ",",
        "width",
        ",",
        "*",
        ",",
        "height",
        "=",
        "1",
        ")",
        ":",
        "return",
        "self",
        ".",
        "width",
        "*",
        "width",
        "*",
        "height",
    ]
    assert area["module"] == "geometry" and area["arguments"] == ["self", "width", "height"]
    grow = by_name["geometry/__init__.py", "Shape.grow"]
    assert grow["code"].startswith("def grow(self, factor):\n    self.size")  # method dedented
    assert by_name["strings.py", "shout"]["code"].startswith(
        "def shout(text,\n          times=1):\n    return"
    )


def test_extraction_is_deterministic(planted_library):
    assert builder.extract_stdlib_pairs(planted_library) == builder.extract_stdlib_pairs(
        planted_library
    )


def test_split_by_module_puts_each_module_in_one_split_near_the_shares():
    pairs = [{"module": f"m{i}"} for i in range(200) for _ in range(1 + i % 3)]
    split_of = builder.split_by_module(pairs)
    sizes = Counter(split_of[p["module"]] for p in pairs)
    assert set(split_of.values()) == {"train", "valid", "test"}
    assert (
        abs(sizes["test"] / len(pairs) - 0.1) < 0.02
        and abs(sizes["valid"] / len(pairs) - 0.1) < 0.02
    )
    assert split_of == builder.split_by_module(list(reversed(pairs)))


def test_normalise_names_renames_function_and_arguments_but_not_attributes():
    code = "def area(self, width):\n    return self.width * width + area(self, 0)\n"
    function, tokens = builder.normalise_names(code, "area", ["self", "width"])
    assert function == "def func(arg_0, arg_1):\n    return arg_0.width * arg_1 + func(arg_0, 0)\n"
    assert tokens == [
        "def",
        "func",
        "(",
        "arg_0",
        ",",
        "arg_1",
        ")",
        ":",
        "return",
        "arg_0",
        ".",
        "width",
        "*",
        "arg_1",
        "+",
        "func",
        "(",
        "arg_0",
        ",",
        "0",
        ")",
    ]
    code = "def digest(key, digest):\n    return digest(key)\n"
    shadowing, _ = builder.normalise_names(code, "digest", ["key", "digest"])
    assert shadowing == "def func(arg_0, arg_1):\n    return arg_1(arg_0)\n"


def test_planted_standin_in_both_layouts_loads_with_the_real_reader(planted_library, tmp_path):
    csn = builder.ensure_stdlib_standin(tmp_path / "data", "csn", stdlib=planted_library)
    advtest = builder.ensure_stdlib_standin(tmp_path / "data", "advtest", stdlib=planted_library)
    assert sorted(p.name for p in csn.iterdir()) == [
        "codebase.jsonl",
        "manifest.json",
        "test.jsonl",
        "train.jsonl",
        "valid.jsonl",
    ]
    assert sorted(p.name for p in advtest.iterdir()) == [
        "manifest.json",
        "test.jsonl",
        "train.jsonl",
        "valid.jsonl",
    ]
    manifest = json.loads((csn / "manifest.json").read_text())
    assert sum(manifest["pairs"].values()) == 5 and manifest["pairs_sharing_their_query"] == 2
    assert manifest["skipped_files"] == ["broken.py: SyntaxError"]
    for split in ("train", "valid", "test"):
        csn_rows = [json.loads(line) for line in (csn / f"{split}.jsonl").read_text().splitlines()]
        adv_rows = [
            json.loads(line) for line in (advtest / f"{split}.jsonl").read_text().splitlines()
        ]
        assert [r["url"] for r in csn_rows] == [r["url"] for r in adv_rows]
        assert len(load(csn / f"{split}.jsonl")) == len(csn_rows)
        if split != "train":
            assert all("function_tokens" in r and "code_tokens" not in r for r in adv_rows)
            assert all(r["function_tokens"][1] == "func" for r in adv_rows)


def test_standin_build_is_idempotent(planted_library, tmp_path):
    folder = builder.ensure_stdlib_standin(tmp_path / "data", "csn", stdlib=planted_library)
    stamp = (folder / "train.jsonl").stat().st_mtime_ns
    assert builder.ensure_stdlib_standin(tmp_path / "data", "csn", stdlib=planted_library) == folder
    assert (folder / "train.jsonl").stat().st_mtime_ns == stamp
    # no staging folder left behind
    assert [p.name for p in folder.parent.iterdir()] == ["stdlib-csn"]
    manifest = json.loads((folder / "manifest.json").read_text())
    # an older builder's output
    (folder / "manifest.json").write_text(json.dumps({**manifest, "builder": 0}))
    builder.ensure_stdlib_standin(tmp_path / "data", "csn", stdlib=planted_library)
    assert (folder / "train.jsonl").stat().st_mtime_ns != stamp
    assert json.loads((folder / "manifest.json").read_text()) == manifest


def test_standin_refuses_an_unknown_variant(tmp_path):
    with pytest.raises(ValueError, match="variant"):
        builder.ensure_stdlib_standin(tmp_path, "cosqa")


@pytest.fixture(scope="module")
def stdlib_standin(tmp_path_factory):
    """Both stand-ins of this Python's standard library, built by the script as a command."""
    root = tmp_path_factory.mktemp("data")
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "build_codesearch_standin.py"), "--root", str(root)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "csn" in done.stdout and "advtest" in done.stdout
    return root / "codesearch" / "stdlib-csn", root / "codesearch" / "stdlib-advtest"


def read_rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_real_stdlib_standin_splits_by_module_without_duplicate_code(stdlib_standin):
    csn, _ = stdlib_standin
    splits = {s: read_rows(csn / f"{s}.jsonl") for s in ("train", "valid", "test")}
    modules = {
        s: {r["path"].split("/")[0].removesuffix(".py") for r in rows} for s, rows in splits.items()
    }
    assert not (
        modules["train"] & modules["valid"]
        or modules["train"] & modules["test"]
        or modules["valid"] & modules["test"]
    )
    codes = [tuple(r["code_tokens"]) for rows in splits.values() for r in rows]
    assert len(codes) == len(set(codes)) > 3000
    assert all(len(splits[s]) > 0.05 * len(codes) for s in ("valid", "test"))
    queries = Counter(tuple(r["docstring_tokens"]) for rows in splits.values() for r in rows)
    assert max(queries.values()) > 1  # identical docstrings stay: natural false negatives


def test_real_stdlib_standin_retrieval_tasks_pair_every_query(stdlib_standin):
    csn, advtest = stdlib_standin
    task = retrieval_task(csn / "test.jsonl", csn / "codebase.jsonl")
    valid_size = len(read_rows(csn / "valid.jsonl"))
    assert len(task.codes) == valid_size + len(task.queries)
    assert task.positive.tolist() == list(range(valid_size, valid_size + len(task.queries)))
    adv = retrieval_task(advtest / "test.jsonl")
    assert adv.queries == task.queries and adv.positive.tolist() == list(range(len(adv.queries)))
    assert all(code.startswith(("def func (", "async def func (")) for code in adv.codes)


def test_download_script_fetches_cosqa_into_the_layout_the_readers_use(tmp_path, monkeypatch):
    served = tmp_path / "served"
    served.mkdir()
    (served / "code_idx_map.txt").write_text(json.dumps(CODE_IDX_MAP))
    for name in (
        "cosqa-retrieval-dev-500.json",
        "cosqa-retrieval-test-500.json",
        "cosqa-retrieval-train-19604.json",
    ):
        (served / name).write_text(json.dumps(COSQA))
    module = script("download_codesearch")
    monkeypatch.setitem(
        module.FILES, "cosqa", [((served / n).as_uri(), n, h) for _, n, h in module.FILES["cosqa"]]
    )
    with pytest.raises(SystemExit) as finished:
        module.main(["--root", str(tmp_path / "data"), "--only", "cosqa"])
    assert finished.value.code == 0
    folder = tmp_path / "data" / "codesearch" / "cosqa"
    task = retrieval_task(folder / "cosqa-retrieval-test-500.json", folder / "code_idx_map.txt")
    assert task.positive.tolist() == [0, 1]


def served_advtest(tmp_path, monkeypatch, preprocess: str):
    """The download script with AdvTest's archives served from files: CodeXGLUE's dataset.zip
    holding `preprocess` as dataset/preprocess.py, and a CodeSearchNet python.zip stand-in."""
    served = tmp_path / "served"
    served.mkdir()
    with zipfile.ZipFile(served / "dataset.zip", "w") as zipped:
        zipped.writestr("dataset/preprocess.py", preprocess)
    with zipfile.ZipFile(served / "python.zip", "w") as zipped:
        zipped.writestr("python/rows.json", json.dumps(ADVTEST_TEST))
    module = script("download_codesearch")
    files = [((served / n).as_uri(), n, h) for _, n, h in module.FILES["advtest"]]
    monkeypatch.setitem(module.FILES, "advtest", files)
    return module


def test_download_script_runs_advtest_preprocessing_shipped_in_the_archive(tmp_path, monkeypatch):
    module = served_advtest(
        tmp_path,
        monkeypatch,
        "import json, pathlib\n"
        "rows = json.loads(pathlib.Path('python/rows.json').read_text())\n"
        "for split in ('train', 'valid', 'test'):\n"
        "    pathlib.Path(split + '.jsonl').write_text(''.join(json.dumps(r) + '\\n' for r in "
        "rows))\n",
    )
    assert (
        module.fetch("advtest", tmp_path / "data") == tmp_path / "data" / "codesearch" / "AdvTest"
    )
    task = retrieval_task(tmp_path / "data" / "codesearch" / "AdvTest" / "test.jsonl")
    assert task.codes == ["def func ( arg_0 ) : return arg_0", "def func ( ) : pass"]


def test_advtest_preprocessing_stopped_midway_is_redone_by_the_next_fetch(tmp_path, monkeypatch):
    module = served_advtest(
        tmp_path,
        monkeypatch,
        "import json, pathlib, sys\n"
        "rows = json.loads(pathlib.Path('python/rows.json').read_text())\n"
        "pathlib.Path('test.jsonl').write_text(json.dumps(rows[0]) + '\\n')\n"
        "if pathlib.Path('stop').exists():\n"
        "    sys.exit(1)\n"
        "pathlib.Path('test.jsonl').write_text(''.join(json.dumps(r) + '\\n' for r in rows))\n",
    )
    folder = tmp_path / "data" / "codesearch" / "AdvTest"
    folder.mkdir(parents=True)
    (folder / "stop").touch()
    with pytest.raises(subprocess.CalledProcessError):
        module.fetch("advtest", tmp_path / "data")
    assert len(retrieval_task(folder / "test.jsonl").codes) == 1  # half done
    (folder / "stop").unlink()
    module.fetch("advtest", tmp_path / "data")
    assert len(retrieval_task(folder / "test.jsonl").codes) == 2
