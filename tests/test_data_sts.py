"""Specification of the SentEval readers (small files in each real format), SimCSE's training file,
and the gensim-wheel stand-in (built by data_scripts/build_sts_standin.py)."""

import bz2
import importlib.util
import json
import tarfile
import zipfile
from pathlib import Path
from xml.sax.saxutils import escape

import pytest
from fetch import pip_wheel

from gcbs_lib.data import data_root
from gcbs_lib.data.sts import (
    STS_YEARS,
    load,
    load_standin,
    read_sentences,
    senteval_path,
    standin_file,
)


def script(name):
    """Import a data_scripts/ script as a module."""
    path = Path(__file__).resolve().parents[1] / "data_scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


standin = script("build_sts_standin")


def write_year(folder, task, empty_gold_in=None):
    """A SentEval year folder: two pairs per sub-dataset, scored 1 and 2 (the first left empty in
    one)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in STS_YEARS[task]:
        (folder / f"STS.input.{name}.txt").write_text(
            f'{name}  one\tother  one\n{name} two\t"quoted" two\n'
        )
        gold = "\n2.0\n" if name == empty_gold_in else "1.0\n2.0\n"
        (folder / f"STS.gs.{name}.txt").write_text(gold)
    return folder


def test_sts12_concatenates_sub_datasets_in_senteval_order_and_drops_empty_gold_lines(tmp_path):
    s1, s2, scores = load(
        write_year(tmp_path / "STS12-en-test", "STS12", empty_gold_in="MSRvid"), "STS12"
    )
    assert s1 == [
        "MSRpar one",
        "MSRpar two",
        "MSRvid two",
        "SMTeuroparl one",
        "SMTeuroparl two",
        "surprise.OnWN one",
        "surprise.OnWN two",
        "surprise.SMTnews one",
        "surprise.SMTnews two",
    ]
    assert s2[:3] == ["other one", '"quoted" two', '"quoted" two']
    assert scores == [1.0, 2.0, 2.0, 1.0, 2.0, 1.0, 2.0, 1.0, 2.0]


@pytest.mark.parametrize("task", ["STS13", "STS14", "STS15", "STS16"])
def test_every_sts_year_reads_its_senteval_sub_datasets(tmp_path, task):
    s1, s2, scores = load(write_year(tmp_path / task, task), task)
    assert len(s1) == len(s2) == len(scores) == 2 * len(STS_YEARS[task])
    assert [s.split()[0] for s in s1[::2]] == list(STS_YEARS[task])


def test_a_missing_sub_dataset_or_a_line_count_mismatch_is_refused(tmp_path):
    folder = write_year(tmp_path / "STS13", "STS13")
    (folder / "STS.gs.FNWN.txt").write_text("1.0\n")
    with pytest.raises(
        ValueError, match="STS.input.FNWN.txt has 2 lines but STS.gs.FNWN.txt has 1"
    ):
        load(folder, "STS13")
    (folder / "STS.gs.FNWN.txt").unlink()
    with pytest.raises(FileNotFoundError, match="STS.gs.FNWN.txt.*FNWN"):
        load(folder, "STS13")
    with pytest.raises(NotADirectoryError):
        load(folder / "STS.input.OnWN.txt", "STS13")


STSB = (
    "main-captions\tMSRvid\t2012test\t0001\t5.000\tA man with a hard hat is dancing.\t"
    "A man wearing a hard hat is dancing.\n"
    'main-news\theadlines\t2013\t0002\t1.5\tHe said "no" to   it\tShe said '
    "'yes'\tsource-a\tsource-b\n"
    'main-forum\tdeft-forum\t2014\t0003\t0.0\t"Unbalanced quote\tclosed"\n'
)


def test_sts_benchmark_reads_columns_4_5_6_without_quote_processing(tmp_path):
    (tmp_path / "sts-test.csv").write_text(STSB)
    s1, s2, scores = load(tmp_path / "sts-test.csv", "STSBenchmark")
    assert s1 == ["A man with a hard hat is dancing.", 'He said "no" to it', '"Unbalanced quote']
    assert s2 == ["A man wearing a hard hat is dancing.", "She said 'yes'", 'closed"']
    assert scores == [5.0, 1.5, 0.0]


SICK = (
    "pair_ID\tsentence_A\tsentence_B\trelatedness_score\tentailment_judgment\n"
    "1\tA group of kids is playing in a yard\tA group of boys is playing outdoors\t4.5\tNEUTRAL\n"
    '2\tA "brown" dog is running\tNobody is running\t3.2\tCONTRADICTION\n'
)


def test_sick_relatedness_skips_the_header_and_reads_columns_1_2_3(tmp_path):
    (tmp_path / "SICK_test_annotated.txt").write_text(SICK)
    s1, s2, scores = load(tmp_path / "SICK_test_annotated.txt", "SICKRelatedness")
    assert s1 == ["A group of kids is playing in a yard", 'A "brown" dog is running']
    assert s2 == ["A group of boys is playing outdoors", "Nobody is running"] and scores == [
        4.5,
        3.2,
    ]


@pytest.mark.parametrize(
    "content, message",
    [
        ("a\tb\tc\td\t4.0\tonly one sentence\n", "at least 7"),
        ("a\tb\tc\td\tfive\tx\ty\n", "not a number"),
        ("a\tb\tc\td\tnan\tx\ty\n", "not finite"),
        ("a\tb\tc\td\t9e999\tx\ty\n", "not finite"),
    ],
)
def test_malformed_split_files_are_refused_naming_the_line(tmp_path, content, message):
    (tmp_path / "sts-dev.csv").write_text("g\tf\ty\ti\t1.0\tx\ty\n" + content)
    with pytest.raises(ValueError, match=f"sts-dev.csv:2: .*{message}"):
        load(tmp_path / "sts-dev.csv", "STSBenchmark")


def test_a_split_file_without_pairs_is_refused(tmp_path):
    (tmp_path / "sts-dev.csv").write_text("\n")
    with pytest.raises(ValueError, match="sts-dev.csv: no STSBenchmark sentence pairs"):
        load(tmp_path / "sts-dev.csv", "STSBenchmark")


def test_senteval_path_finds_each_task_in_the_unpacked_archive(tmp_path):
    downstream = tmp_path / "SentEval" / "downstream"
    write_year(downstream / "STS" / "STS14-en-test", "STS14")
    (downstream / "STS" / "STSBenchmark").mkdir()
    (downstream / "STS" / "STSBenchmark" / "sts-dev.csv").write_text(STSB)
    (downstream / "SICK").mkdir()
    (downstream / "SICK" / "SICK_trial.txt").write_text(SICK)
    assert senteval_path("STS14", tmp_path) == downstream / "STS" / "STS14-en-test"
    assert (
        senteval_path("STSBenchmark", tmp_path, "dev")
        == downstream / "STS" / "STSBenchmark" / "sts-dev.csv"
    )
    assert len(load(senteval_path("SICKRelatedness", tmp_path, "dev"), "SICKRelatedness")[0]) == 2
    with pytest.raises(FileNotFoundError, match="STS12-en-test"):
        senteval_path("STS12", tmp_path)
    with pytest.raises(ValueError, match="split"):
        senteval_path("STSBenchmark", tmp_path, "validation")


def test_an_unknown_task_is_refused(tmp_path):
    with pytest.raises(ValueError, match="task must be one of"):
        load(tmp_path, "STS17")


def test_simcse_training_sentences_one_per_line(tmp_path):
    (tmp_path / "wiki1m_for_simcse.txt").write_text(
        "First sentence.\n\n  Second, with a tab\tinside.  \n"
    )
    assert read_sentences(tmp_path / "wiki1m_for_simcse.txt") == [
        "First sentence.",
        "Second, with a tab\tinside.",
    ]
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(ValueError, match="no sentences"):
        read_sentences(tmp_path / "empty.txt")


ARTICLE = """{{Infobox|name={{nested|x}}}}
'''Alpha''' is the [[Greek alphabet|first letter]] of the alphabet.<ref>A source.</ref> \
It comes before beta in order.
== History ==
* A list item that is skipped entirely.
[[File:Alpha.svg|thumb|A picture [[caption]].]]
It was used by the [[Phoenicia]]ns long ago. Short one.
It comes before beta in order.
"""


def page(title, namespace, text):
    """One <page> of a MediaWiki XML dump; the wikitext is XML-escaped as in real dumps."""
    revision = f"<revision><text>{escape(text)}</text></revision>"
    return f"<page><title>{title}</title><ns>{namespace}</ns>{revision}</page>"


PLANTED_DUMP = (
    '<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/">'
    + page("Alpha", 0, ARTICLE)
    + page("Talk:Alpha", 1, "Talk pages are not articles at all.")
    + page("Alfa", 0, "#REDIRECT [[Alpha]] is not a sentence here.")
    + "</mediawiki>"
)


def test_wikipedia_sentences_strip_markup_and_keep_article_sentences_once():
    assert standin.wikipedia_sentences(bz2.compress(PLANTED_DUMP.encode())) == [
        "Alpha is the first letter of the alphabet.",
        "It comes before beta in order.",
        "It was used by the Phoenicians long ago.",
    ]


def test_a_wheel_whose_data_differs_from_gensim_4_4_0_is_refused(tmp_path):
    wheel = tmp_path / "gensim-4.4.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zipped:
        for name in standin.WHEEL_FILES:
            zipped.writestr("gensim/test/test_data/" + name, b"planted")
    with pytest.raises(ValueError, match="SHA-256"):
        standin.build(tmp_path / "data", wheel=wheel)


@pytest.fixture(scope="module")
def gensim_wheel():
    """The real gensim 4.4.0 wheel, cached in the kit's data root (fetched with pip once)."""
    try:
        return pip_wheel(standin.GENSIM_WHEEL, data_root() / "sts" / "downloads")
    except RuntimeError as error:
        pytest.skip(f"no gensim wheel and PyPI unreachable: {error}")


@pytest.fixture(scope="module")
def standin_root(gensim_wheel, tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    standin.build(root, wheel=gensim_wheel)
    return root


def test_gensim_standin_sizes_and_formats(standin_root):
    folder = standin_file("train.txt", standin_root).parent
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["sizes"]["lee.tsv"] == 1225 and manifest["sizes"]["wordsim353.tsv"] == 353
    assert (
        manifest["sizes"]["simlex999.tsv"] == 999 and 15000 < manifest["sizes"]["train.txt"] < 20000
    )
    sentences = read_sentences(folder / "train.txt")
    assert len(sentences) == len(set(sentences)) == manifest["sizes"]["train.txt"]
    lee = load_standin("lee", standin_root)
    assert len(set(lee[0]) | set(lee[1])) == 50 and all(0 <= s <= 1 for s in lee[2])
    assert "£" in " ".join(lee[0])  # Latin-1 decoded
    words = load_standin("simlex999", standin_root)
    assert (words[0][0], words[1][0], words[2][0]) == ("old", "new", 1.58)
    dev, test = load_standin("lee-dev", standin_root), load_standin("lee-test", standin_root)
    assert len(dev[2]) == len(test[2]) == 300 and not (set(dev[0]) | set(dev[1])) & (
        set(test[0]) | set(test[1])
    )


def test_the_lee_split_keeps_every_document_in_one_half():
    documents = [f"document {i}" for i in range(10)]
    pairs = [
        (a, b, float(i + j))
        for i, a in enumerate(documents)
        for j, b in enumerate(documents)
        if i < j
    ]
    dev, test = standin.split_by_document(pairs)
    dev_docs, test_docs = {t for p in dev for t in p[:2]}, {t for p in test for t in p[:2]}
    assert not dev_docs & test_docs and len(dev_docs) == len(test_docs) == 5
    assert len(dev) == len(test) == 10  # C(5, 2) each; the 25 pairs across the halves are dropped


def test_gensim_standin_is_the_same_from_a_wheel_with_windows_line_ends(
    gensim_wheel, standin_root, tmp_path
):
    crlf = tmp_path / "gensim-4.4.0-cp312-cp312-win_amd64.whl"
    with zipfile.ZipFile(gensim_wheel) as source, zipfile.ZipFile(crlf, "w") as target:
        for name in standin.WHEEL_FILES:
            data = source.read("gensim/test/test_data/" + name)
            target.writestr(
                "gensim/test/test_data/" + name,
                data if name.endswith(".bz2") else data.replace(b"\n", b"\r\n"),
            )
    manifests = [
        json.loads((standin.build(root, wheel=wheel) / "manifest.json").read_text())
        for root, wheel in ((standin_root, None), (tmp_path, crlf))
    ]
    assert manifests[0]["sha256"] == manifests[1]["sha256"]


def test_gensim_standin_build_is_idempotent(standin_root):
    folder = standin_file("train.txt", standin_root).parent
    stamp = (folder / "train.txt").stat().st_mtime_ns
    assert standin.build(standin_root) == folder  # built: no wheel needed
    assert (folder / "train.txt").stat().st_mtime_ns == stamp
    # no staging folder left behind
    assert [p.name for p in folder.parent.iterdir()] == ["gensim-standin"]
    with pytest.raises(ValueError, match="stand-in evaluation sets"):
        load_standin("STSBenchmark", standin_root)


def test_a_missing_standin_is_built_by_its_data_script(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr("gcbs_lib.data.run_data_script", lambda *args: calls.append(args))
    assert standin_file("lee.tsv", tmp_path) == tmp_path / "sts" / "gensim-standin" / "lee.tsv"
    assert calls == [("build_sts_standin.py", "--root", tmp_path)]


def test_download_script_unpacks_senteval_where_the_readers_find_it(tmp_path, monkeypatch, capsys):
    served = tmp_path / "served"
    write_year(served / "downstream" / "STS" / "STS15-en-test", "STS15")
    with tarfile.open(tmp_path / "senteval.tar", "w") as tar:
        tar.add(served / "downstream", arcname="downstream")
    download_sts = script("download_sts")
    monkeypatch.setattr(download_sts, "BASE", tmp_path.as_uri() + "/")
    with pytest.raises(SystemExit) as finished:
        download_sts.main(["--root", str(tmp_path / "data"), "--only", "senteval", "wiki1m"])
    assert finished.value.code == 1  # wiki1m is not served
    output = capsys.readouterr()
    assert "first fetch: recorded in" in output.out and "wiki1m: UNREACHABLE" in output.err
    year = senteval_path("STS15", tmp_path / "data" / "sts" / "SentEval")
    assert len(load(year, "STS15")[0]) == 2 * len(STS_YEARS["STS15"])


def test_an_unpack_stopped_midway_leaves_no_folder_and_the_next_one_completes(tmp_path):
    (tmp_path / "downstream").mkdir()
    (tmp_path / "downstream" / "a.txt").write_text("a" * 5000)
    with tarfile.open(tmp_path / "good.tar", "w") as tar:
        tar.add(tmp_path / "downstream", arcname="downstream")
    (tmp_path / "cut.tar").write_bytes((tmp_path / "good.tar").read_bytes()[:3000])
    unpack = script("download_sts").unpack
    with pytest.raises(tarfile.TarError):
        unpack(tmp_path / "cut.tar", tmp_path / "SentEval")
    assert not (tmp_path / "SentEval").exists()
    assert not script("download_sts").unpacked(tmp_path / "cut.tar", tmp_path / "SentEval")
    unpack(tmp_path / "good.tar", tmp_path / "SentEval")
    assert script("download_sts").unpacked(tmp_path / "good.tar", tmp_path / "SentEval")
    assert (tmp_path / "SentEval" / "downstream" / "a.txt").read_text() == "a" * 5000
    assert not (tmp_path / "SentEval.part").exists()


def test_download_script_refuses_a_tar_member_outside_the_target(tmp_path):
    with tarfile.open(tmp_path / "evil.tar", "w") as tar:
        (tmp_path / "x.txt").write_text("x")
        tar.add(tmp_path / "x.txt", arcname="../escaped.txt")
    with pytest.raises((tarfile.TarError, ValueError), match="outside|unsafe"):
        script("download_sts").unpack(tmp_path / "evil.tar", tmp_path / "target")
    assert not (tmp_path / "escaped.txt").exists()


mlm_bert = script("build_mlm_bert")


def test_the_shipped_start_assembles_to_the_weights_its_rows_name(tmp_path):
    mlm_bert.main(["--embeddings", "minilm", "--root", str(tmp_path)])
    manifest = json.loads((tmp_path / "models/mlm-bert-minilm-emb/manifest.json").read_text())
    assert manifest["weights"] == "shipped"
    assert manifest["weights_sha256"] == mlm_bert.SHIPPED_SHA256


def test_a_changed_shipped_file_is_refused_naming_both_weights(tmp_path, monkeypatch):
    from safetensors.torch import load_file, save_file

    tensors = load_file(mlm_bert.SHIPPED)
    tensors["pooler.dense.bias"][0] += 1
    changed = tmp_path / "changed.safetensors"
    save_file(tensors, changed)
    monkeypatch.setattr(mlm_bert, "SHIPPED", changed)
    with pytest.raises(ValueError, match="not the recorded @86dde90"):
        mlm_bert.main(["--embeddings", "minilm", "--root", str(tmp_path)])
    assert not (tmp_path / "models/mlm-bert-minilm-emb").exists()
