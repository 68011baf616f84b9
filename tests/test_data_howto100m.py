"""Specification of the HowTo100M readers, feature pooling, bag builder and the offline sources'
formats."""

import importlib.util
import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest

from gcbs_lib.data.howto100m import (
    FPS,
    FeatureStore,
    build_bags,
    caption_path,
    clip_features,
    features_of,
    nearest_bag,
    open_arrays,
    read_captions,
    save_arrays,
    widen,
)


def data_script(name):
    spec = importlib.util.spec_from_file_location(
        name, Path(__file__).resolve().parents[1] / "data_scripts" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


planted, standin = data_script("howto100m_planted"), data_script("howto100m_standin")
CAPTIONS = {
    "abc": {
        "start": [0.0, 2.5, 7.0],
        "end": [2.0, 6.0, 9.5],
        "text": ["cut the onion", "now, stir", 'say "hi"'],
    },
    "x-y_z": {"start": [1.0], "end": [3.0], "text": ["only one"]},
}


@pytest.mark.parametrize(
    "fmt, name", [("json", "caption.json"), ("pickle", "caption.pickle"), ("csv", "captions")]
)
def test_every_caption_format_round_trips(tmp_path, fmt, name):
    assert read_captions(planted.write_captions(CAPTIONS, tmp_path / name, fmt)) == CAPTIONS


def test_the_published_layouts_read_as_written_by_their_tools(tmp_path):
    (tmp_path / "csv").mkdir()
    (tmp_path / "csv" / "abc.csv").write_text(
        'start,end,text\n0,2,cut the onion\n2.5,6,"now, stir"\n7,9.5,"say ""hi"""\n'
    )
    (tmp_path / "csv" / "x-y_z.csv").write_text("start,end,text\n1.0,3.0,only one\n")
    assert read_captions(tmp_path / "csv") == CAPTIONS
    as_numpy = {
        v: {k: np.array(c[k], dtype=object if k == "text" else float) for k in c}
        for v, c in CAPTIONS.items()
    }
    (tmp_path / "caption.pickle").write_bytes(pickle.dumps(as_numpy))
    assert read_captions(tmp_path / "caption.pickle") == CAPTIONS


class RunsCode:
    def __reduce__(self):
        return os.system, ("touch pwned",)


def test_a_caption_pickle_that_would_run_code_is_refused_without_running_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "caption.pickle").write_bytes(
        pickle.dumps({"v": {"start": [0], "end": [1], "text": [RunsCode()]}})
    )
    with pytest.raises(pickle.UnpicklingError, match="only plain containers"):
        read_captions(tmp_path / "caption.pickle")
    assert not (tmp_path / "pwned").exists()


def test_malformed_captions_are_refused_clearly(tmp_path):
    (tmp_path / "caption.json").write_text(
        json.dumps({"v": {"start": [0, 1], "end": [1], "text": ["a", "b"]}})
    )
    with pytest.raises(ValueError, match="2 starts, 1 ends"):
        read_captions(tmp_path / "caption.json")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "v.csv").write_text("begin,end,text\n0,1,a\n")
    with pytest.raises(ValueError, match="start,end,text"):
        read_captions(tmp_path / "bad")
    with pytest.raises(ValueError, match="expected caption.json"):
        read_captions(tmp_path / "captions.txt")
    (tmp_path / "caption.json").write_text(
        json.dumps({"v": {"start": [0, 1], "end": [1, 2], "text": "ab"}})
    )
    with pytest.raises(ValueError, match="each a list"):
        read_captions(tmp_path / "caption.json")


def test_given_a_skipped_dict_videos_with_bad_captions_are_left_out_and_listed(tmp_path):
    (tmp_path / "csv").mkdir()
    (tmp_path / "csv" / "good.csv").write_text("start,end,text\n0,1,a\n")
    (tmp_path / "csv" / "columns.csv").write_text("begin,end,text\n0,1,a\n")
    (tmp_path / "csv" / "bytes.csv").write_bytes(b"start,end,text\n0,1,\xff\n")
    skipped = {}
    assert read_captions(tmp_path / "csv", skipped) == {
        "good": {"start": [0.0], "end": [1.0], "text": ["a"]}
    }
    assert set(skipped) == {"columns", "bytes"} and "UnicodeDecodeError" in skipped["bytes"]


def test_a_clip_is_the_normalised_max_over_its_rows_at_each_streams_rate():
    rows_2d = np.arange(20, dtype=np.float32).reshape(10, 2)  # 1 row per second
    rows_3d = np.arange(15, dtype=np.float32)[:, None] * np.ones((1, 3))  # 1.5 rows per second
    features, present = clip_features(
        {"2d": rows_2d, "3d": rows_3d}, np.array([[2.0, 4.2], [20.0, 30.0]])
    )
    assert FPS == {"2d": 1.0, "3d": 1.5}
    # rows 2…4
    np.testing.assert_allclose(features[0, :2], rows_2d[4] / np.linalg.norm(rows_2d[4]), rtol=1e-6)
    # rows 3…6
    np.testing.assert_allclose(features[0, 2:], rows_3d[6] / np.linalg.norm(rows_3d[6]), rtol=1e-6)
    assert present.tolist() == [True, False] and not features[1].any()


def test_bags_grow_toward_the_shorter_time_span_and_stop_at_the_edges():
    start, end = np.array([0.0, 10.0, 12.0, 14.0, 30.0]), np.array([1.0, 11.0, 13.0, 15.0, 31.0])
    # 1 and 3 tie (3 s each): go right, then left (5 s beats 19 s)
    assert nearest_bag(start, end, 2, 3) == 1
    assert nearest_bag(start, end, 3, 2) == 2  # 12→15 beats 14→31
    assert nearest_bag(start, end, 0, 3) == 0 and nearest_bag(start, end, 4, 3) == 2
    assert nearest_bag(start, end, 1, 9) == 0  # K above the caption count: the whole video
    assert widen(10.0, 11.0, 5.0) == (8.0, 13.0) and widen(0.5, 1.0, 5.0) == (0.0, 5.0)


def write_features(root, video_id, seconds, dim=4, seed=0):
    rng = np.random.default_rng(seed)
    for stream, fps in FPS.items():
        (root / f"features_{stream}").mkdir(parents=True, exist_ok=True)
        np.save(
            root / f"features_{stream}" / f"{video_id}.npy",
            rng.standard_normal((int(seconds * fps), dim)).astype(np.float16),
        )


def test_corrupt_truncated_or_wrong_feature_files_are_skipped_and_listed(tmp_path):
    captions = {v: {"start": [0.0, 3.0], "end": [2.0, 5.0], "text": ["a", "b"]} for v in "abcdefg"}
    for v in captions:
        write_features(tmp_path, v, 10)

    def path(v):
        return tmp_path / "features_3d" / f"{v}.npy"

    path("b").write_bytes(path("b").read_bytes()[:100])  # truncated
    path("c").write_bytes(b"not a numpy file at all")  # corrupt
    np.save(path("d"), np.zeros((15, 5), np.float16))  # another width
    np.save(path("e"), np.full((15, 4), np.nan, np.float16))  # NaN
    os.remove(path("f"))  # missing
    np.save(path("g"), np.zeros(4, np.float16))  # not [T, dim]
    store = FeatureStore(tmp_path)
    bags = build_bags(captions, store, k=2)
    assert bags["video_ids"].tolist() == ["a"]
    assert sorted(store.skipped) == list("bcdefg")
    assert (
        "(15, 5)" in store.skipped["d"]
        and "NaN" in store.skipped["e"]
        and "shape (4,)" in store.skipped["g"]
    )


def test_captions_overlapping_a_clip_outside_its_bag_are_excluded_from_its_negatives(tmp_path):
    write_features(tmp_path, "v", 40)
    captions = {
        "v": {"start": [0.0, 1.0, 2.0, 20.0], "end": [6.0, 3.0, 4.0, 22.0], "text": list("abcd")}
    }
    bags = build_bags(captions, FeatureStore(tmp_path), k=1, min_time=2.0)
    assert bags["bag_idx"][:, 0].tolist() == [0, 1, 2, 3]
    assert [sorted(r[r >= 0].tolist()) for r in bags["exclude_idx"]] == [[1, 2], [0, 2], [0, 1], []]
    np.testing.assert_array_equal(bags["clip_window"][1], [1.0, 3.0])


def test_bags_are_memory_mapped_index_arrays_and_batch_features_are_pooled_from_the_video_files(
    tmp_path,
):
    planted.write_planted(tmp_path, planted.PlantedConfig(videos=4, dim=8, sigma=1.0))
    store = FeatureStore(tmp_path)
    bags = build_bags(read_captions(caption_path(tmp_path)), store, k=3)
    mapped = open_arrays(save_arrays(bags, tmp_path / "bags"))
    assert set(mapped) == set(bags) and all(isinstance(a, np.memmap) for a in mapped.values())
    for name, array in bags.items():
        np.testing.assert_array_equal(mapped[name], array)
    rows = np.array([5, 0, 17, 5])
    one_by_one = [
        clip_features(
            store.load(str(mapped["video_ids"][mapped["clip_video"][m]])),
            mapped["clip_window"][m][None],
        )[0][0]
        for m in rows
    ]
    np.testing.assert_array_equal(features_of(store, mapped, rows), np.stack(one_by_one))
    assert bags["bag_idx"].shape[1] == 3 and bags["caption_text"].dtype.kind == "S"


def test_planted_data_reads_the_same_in_every_caption_format(tmp_path):
    config = planted.PlantedConfig(videos=3, dim=8, sigma=2.0)
    for fmt in ("json", "pickle", "csv"):
        planted.write_planted(tmp_path / fmt, config, fmt)
    read = [read_captions(caption_path(tmp_path / fmt)) for fmt in ("json", "pickle", "csv")]
    assert read[0] == read[1] == read[2] and sorted(read[0]) == ["v00000", "v00001", "v00002"]
    features = np.load(tmp_path / "json" / "features_3d" / "v00000.npy")
    assert features.dtype == np.float16 and features.shape == (int(6 * 6.0 * 1.5), 8)
    np.testing.assert_allclose(np.linalg.norm(features.astype(np.float32), axis=1), 1.0, atol=1e-3)


RST = """Title
=====

The first paragraph explains what the example below does in some detail::

   >>> print("hi")
   hi

A paragraph between two code blocks, long enough to count as narration.

.. code-block:: python

   x = 1
   y = 2

.. index:: single: something

The closing paragraph describes the second example and what it printed.
"""


def test_python_doc_pages_become_prose_and_code_blocks_in_order():
    assert standin.narrated_blocks(RST) == [
        ("prose", "The first paragraph explains what the example below does in some detail:"),
        ("code", '>>> print("hi")\nhi'),
        ("prose", "A paragraph between two code blocks, long enough to count as narration."),
        ("code", "x = 1\ny = 2"),
        ("prose", "The closing paragraph describes the second example and what it printed."),
    ]


def test_the_python_doc_standin_is_written_in_the_howto100m_layout(tmp_path):
    def encode(texts):
        return np.array([[len(t), t.count("="), 1.0] for t in texts])

    clips = standin.write_python_doc_standin(
        tmp_path, {"page": standin.narrated_blocks(RST)}, {"2d": encode, "3d": encode}
    )
    store = FeatureStore(tmp_path)
    bags = build_bags(read_captions(tmp_path / "caption.json"), store, k=1, clip_windows=clips)
    texts = bags["caption_text"][bags["bag_idx"][:, 0]].tolist()
    assert texts[0].startswith(b"The first paragraph") and texts[1].startswith(
        b"A paragraph between"
    )
    expected = encode(["x = 1\ny = 2"])[0]
    features = features_of(store, bags, np.array([1]))[0]
    np.testing.assert_allclose(features, np.tile(expected / np.linalg.norm(expected), 2), rtol=1e-3)


def test_each_section_of_a_page_is_a_video_of_its_own():
    page = f"{RST}\n=======\nOverlined\n=======\n\nIts text.\n\nSecond\n------\n\nMore text.\n"
    parts = standin.sections(page)
    assert [part.splitlines()[0] for part in parts] == ["Title", "=======", "Second"]
    assert parts[0].rstrip("\n") == RST.rstrip("\n") and parts[1].splitlines()[1] == "Overlined"
    assert standin.sections("No heading at all.\n\n   ----\n") == ["No heading at all.\n\n   ----"]
