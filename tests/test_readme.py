"""Every command README.md and docs/*.md show is run here, so they cannot drift from what works.

Each test runs its command as written plus, where it would run notebooks for long, options
that keep it small (tiny parameters, or `--prepare-only`: papermill injects the parameters without
executing), and writes into a temporary folder. `make` runs with `-o .venv/.installed` so a test
never reinstalls the shared venv (`make test` itself installed it first). Two commands cannot run
inside the test suite and are checked as a dry run (`make -n`): `make install` with a PyTorch index
(not reachable offline) and `make test` (it runs this file).
"""

import ast
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import nbformat
import papermill
import pytest
import yaml
from conftest import child_command_lines

from gcbs_lib.train import load_config

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
RESULTS_PAGE = (ROOT / "docs" / "results.md").read_text()
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NO_REINSTALL = "make -o .venv/.installed"
TINY_01 = (
    '-p chunk_sizes "[1, 7]" -p memory_batch_sizes "[16, 48]" -p timing_batch_size 32 -p '
    "timing_repeats 1"
)
RUNS = {}  # command shown in README.md or docs/ -> the test that runs it


def shown_commands():
    """The lines of the ```bash blocks of README.md and docs/*.md, without their comments."""
    text = "".join(page.read_text() for page in PAGES)
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    return [
        line.split(" # ")[0].strip()
        for block in blocks
        for line in block.splitlines()
        if line.strip()
    ]


def runs(*commands):
    def register(test):
        RUNS.update(dict.fromkeys(commands, test.__name__))
        return test

    return register


def sh(command, timeout=600, check=True):
    """Run a shell command from the repository root (make never reinstalls); return its stdout."""
    command = (
        command.replace("make ", NO_REINSTALL + " ", 1) if command.startswith("make ") else command
    )
    done = subprocess.run(
        command,
        shell=True,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    if check and done.returncode != 0:
        raise AssertionError(
            f"{command} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    return done.stdout


def injected(notebook):
    cell = next(
        c
        for c in nbformat.read(notebook, as_version=4).cells
        if "injected-parameters" in c.metadata.get("tags", [])
    )
    return {s.targets[0].id: ast.literal_eval(s.value) for s in ast.parse(cell.source).body}


def test_every_command_the_readme_and_the_docs_show_is_run_by_a_test():
    assert set(shown_commands()) == set(RUNS), (
        "a command of README.md or docs/ without a test here, or a test for one they dropped"
    )
    assert all(name in globals() for name in RUNS.values())


@runs("make reproduce")
def test_make_reproduce_prepares_every_notebook_into_a_run_folder(tmp_path):
    sh(f'make reproduce ARGS="--prepare-only --output-dir {tmp_path}"')
    notebooks = sorted(p.name for p in (ROOT / "notebooks").glob("[0-9]*.ipynb"))
    assert sorted(p.name for p in tmp_path.glob("*.ipynb")) == notebooks
    assert {
        r["status"] for r in json.loads((tmp_path / "run.json").read_text())["notebooks"].values()
    } == {"prepared"}
    assert (tmp_path / "results.md").exists()


@runs('.venv/bin/python -m gcbs_lib.reproduce --only 01 -p memory_batch_sizes "[16, 64]"')
def test_runner_parameters_arrive_as_yaml_literals(tmp_path):
    sh(
        '.venv/bin/python -m gcbs_lib.reproduce --only 01 -p memory_batch_sizes "[16, 64]" '
        "--prepare-only "
        f"--output-dir {tmp_path}"
    )
    assert injected(tmp_path / "01_gradcache.ipynb")["memory_batch_sizes"] == [16, 64]


@runs(
    ".venv/bin/papermill --cwd notebooks notebooks/01_gradcache.ipynb runs/01_gradcache.ipynb "
    '-y "memory_batch_sizes: [16, 64]"'
)
def test_papermill_takes_a_list_with_y(tmp_path):
    sh(
        ".venv/bin/papermill --cwd notebooks notebooks/01_gradcache.ipynb "
        f"{tmp_path}/01_gradcache.ipynb "
        f'-y "memory_batch_sizes: [16, 64]" --prepare-only'
    )
    assert injected(tmp_path / "01_gradcache.ipynb")["memory_batch_sizes"] == [16, 64]


@runs(".venv/bin/python -m gcbs_lib.reproduce --profile cpu")
def test_cpu_profile_applies_each_notebooks_profile_file(tmp_path):
    sh(
        ".venv/bin/python -m gcbs_lib.reproduce --profile cpu --prepare-only --output-dir "
        f"{tmp_path}"
    )
    for profile_file in (ROOT / "notebooks" / "params").glob("*.cpu.yaml"):
        parameters = injected(tmp_path / profile_file.name.replace(".cpu.yaml", ".ipynb"))
        assert parameters.items() >= yaml.safe_load(profile_file.read_text()).items()
        assert parameters["profile"] == "cpu"


@runs(
    ".venv/bin/python -m gcbs_lib.reproduce --profile paper -p device cuda --nproc 8 --backend nccl"
)
def test_gpu_node_command_passes_device_to_all_and_ranks_or_gpus_to_the_notebooks_that_take_them(
    tmp_path,
):
    sh(
        ".venv/bin/python -m gcbs_lib.reproduce --profile paper -p device cuda --nproc 8 "
        "--backend nccl "
        f"--prepare-only --output-dir {tmp_path}"
    )
    for notebook in tmp_path.glob("*.ipynb"):
        parameters = injected(notebook)
        assert parameters["device"] == "cuda" and parameters["profile"] == "paper"
        names = papermill.inspect_notebook(str(ROOT / "notebooks" / notebook.name))
        given = {"nproc": 8, "backend": "nccl"}  # each to the notebooks with that parameter
        assert {k: v for k, v in parameters.items() if k in given} == {
            k: v for k, v in given.items() if k in names
        }
    assert injected(tmp_path / "08_gcbs_moco.ipynb")["nproc"] == 8  # its GPUs, for its runs


@runs(".venv/bin/python -m gcbs_lib.reproduce --profile paper --only 04 -p profile paper-advtest")
def test_advtest_with_its_two_epochs_is_reachable_from_the_runner(tmp_path):
    sh(
        ".venv/bin/python -m gcbs_lib.reproduce --profile paper --only 04 -p profile paper-advtest "
        f"--prepare-only --output-dir {tmp_path}"
    )
    parameters = injected(tmp_path / "04_gcbs_codesearch.ipynb")
    config = load_config("codesearch", parameters["profile"])
    assert (parameters["nproc"], config.options.data, config.epochs) == (4, "advtest", 2)


@runs(
    ".venv/bin/python -m gcbs_lib.reproduce --profile cpu --output-dir runs/cpu",
    ".venv/bin/python -m gcbs_lib.results collect runs/cpu",
    ".venv/bin/python -m gcbs_lib.results readme",
)
def test_a_run_of_notebook_01_is_collected_into_results_and_the_generated_tables(tmp_path):
    run, committed = tmp_path / "cpu", tmp_path / "results"
    readme, page = tmp_path / "README.md", tmp_path / "results.md"
    sh(
        f".venv/bin/python -m gcbs_lib.reproduce --profile cpu --output-dir {run} --only 01 "
        f"{TINY_01}"
    )
    # named by its figure: tag
    assert (run / "figures" / "01_gradcache_memory-vs-batch-size.png").is_file()
    readme.write_text(README)
    page.write_text(RESULTS_PAGE)
    sh(
        f".venv/bin/python -m gcbs_lib.results collect {run} --results-dir {committed} --pages "
        f"{readme} {page}"
    )
    rows = json.loads((committed / "01_gradcache.cpu.json").read_text())
    assert rows and {r["profile"] for r in rows} == {"cpu"}
    assert "| gradcache | max_rel_grad_error_float64 | — | — | kit |" in page.read_text()
    regenerated = sh(
        f".venv/bin/python -m gcbs_lib.results readme --results-dir {committed} --pages {readme} "
        f"{page}"
    )
    assert regenerated.count("is up to date") == 2


@runs(
    ".venv/bin/torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint "
    "node0:29500 --rdzv-id gcbs "
    "-m gcbs_lib.train --experiment codesearch --profile paper --sampler gcbs --output-dir "
    "runs/codesearch-paper"
)
def test_multi_node_training_command_rendezvouses_and_trains(tmp_path):
    """On one node with two CPU ranks, the ci profile and two steps: the same rendezvous and
    training path."""
    endpoint = f"127.0.0.1:{free_port()}"
    sh(
        ".venv/bin/torchrun --nnodes 1 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint "
        f"{endpoint} "
        "--rdzv-id gcbs -m gcbs_lib.train --experiment codesearch --profile ci --sampler gcbs "
        f"--output-dir {tmp_path} "
        f"--set max_steps=2"
    )
    rows = json.loads((tmp_path / "results.json").read_text())
    assert {(r["experiment"], r["arm"]) for r in rows} == {("codesearch", "gcbs")}
    assert (tmp_path / "checkpoint.pt").exists()


@runs(
    "make install TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu",
    "make install TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128",
)
@pytest.mark.parametrize("build", ["cpu", "cu128"])
def test_make_install_passes_the_torch_index_to_the_torch_step_only(build):
    url = f"https://download.pytorch.org/whl/{build}"
    plan = subprocess.run(
        ["make", "-n", "-W", "requirements.txt", "install", f"TORCH_INDEX_URL={url}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert [line for line in plan.splitlines() if "--index-url" in line] == [
        f".venv/bin/python -m pip install --quiet torch==2.13.0 --index-url {url}"
    ]
    plain = subprocess.run(
        ["make", "-n", "-W", "requirements.txt", "install"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "pip install --quiet torch==2.13.0 " in plain and "--index-url" not in plain


@runs("make test")
def test_make_test_runs_pytest_nbval_and_the_drift_check():
    plan = sh("make -n test")
    assert (
        ".venv/bin/pytest tests" in plan
        and "--nbval-lax" in plan
        and "jupytext --quiet --to py:percent" in plan
    )


@runs(".venv/bin/python bench/bench_gcbs.py --help")
def test_the_benchmark_explains_itself():
    assert "usage" in sh(".venv/bin/python bench/bench_gcbs.py --help")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url, data=None, method="GET"):
    request = urllib.request.Request(
        url,
        data=json.dumps(data).encode() if data is not None else None,
        method=method,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read() or b"null")


@runs("make lab")
def test_make_lab_serves_the_notebooks_with_jupytext_pairing_and_the_venv_kernel():
    port, token = free_port(), secrets.token_hex(8)
    arguments = f"--no-browser --port={port} --IdentityProvider.token={token}" + (
        " --allow-root" if os.geteuid() == 0 else ""
    )
    lab = subprocess.Popen(
        shlex.split(f'{NO_REINSTALL} lab LAB_ARGS="{arguments}"'),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    # removed below; never committed
    scratch = ROOT / "notebooks" / f"_lab_pairing_test_{os.getpid()}"
    api = f"http://127.0.0.1:{port}/api"
    try:
        for _ in range(120):
            try:
                assert get(f"{api}/status?token={token}")["started"]
                break
            except OSError:
                assert lab.poll() is None, "make lab exited"
                time.sleep(0.5)
        # a .py opened as a notebook
        script = get(f"{api}/contents/01_gradcache.py?type=notebook&token={token}")
        assert (
            script["type"] == "notebook"
            and script["content"]["metadata"]["kernelspec"]["name"] == "python3"
        )
        notebook = script["content"]
        notebook["cells"] = notebook["cells"][:2]
        get(f"{api}/contents/{scratch.name}?token={token}", {"type": "directory"}, "PUT")
        get(
            f"{api}/contents/{scratch.name}/paired.ipynb?token={token}",
            {"type": "notebook", "content": notebook},
            "PUT",
        )
        # saving wrote both files
        assert 'tags=["parameters"]' in (scratch / "paired.py").read_text()
        assert (scratch / "paired.ipynb").exists()
        kernel = get(f"{api}/kernels?token={token}", {"name": "python3"}, "POST")
        kernels = [
            command
            for command in child_command_lines(lab.pid)
            if "ipykernel_launcher" in " ".join(command)
        ]
        assert kernels and Path(kernels[0][0]).parent == ROOT / ".venv" / "bin"  # the venv's Python
        get(f"{api}/kernels/{kernel['id']}?token={token}", method="DELETE")
    finally:
        os.killpg(lab.pid, signal.SIGTERM)
        lab.wait(timeout=30)
        shutil.rmtree(scratch, ignore_errors=True)
