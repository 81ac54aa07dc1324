"""The text-file dataset (runtime/text_data.py): `parc run ... --data corpus.txt`.

A hook over a file packs its token stream (bytes, or a local tokenizer's ids) into
non-overlapping windows of T + 1 tokens and yields this rank's share of each
global batch, shaped like the model's example batch. No process group: a
DataContext says which rank is asking.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from parc.compiler.data_context import DataContext
from parc.errors import ParcError
from parc.runtime import text_data
from parc.runtime.text_data import batch_form, demo_corpus, text_hook

B, T = 4, 7  # global batch and sequence length of the example; windows of 8 tokens

LINES = [
    "the cat sat on the mat",
    "the dog sat on the log",
    "a cat and a dog met on the mat",
]


def _example(batch: int = B, seq: int = T, dtype: torch.dtype = torch.long) -> tuple[Any, Any]:
    """A traced (inputs, targets) of token ids: inputs of `dtype`, int64 targets."""
    return torch.zeros(batch, seq, dtype=dtype), torch.zeros(batch, seq, dtype=torch.long)


def _ctx(dp_rank: int = 0, dp_size: int = 1, epoch: int = 0, **flags: bool) -> DataContext:
    return DataContext(
        dp_rank=dp_rank,
        dp_size=dp_size,
        batch=B // dp_size,
        global_batch=B,
        micro_batch=B // dp_size,
        epoch=epoch,
        seed=3,
        **flags,
    )


def _corpus(tmp_path: Path, data: bytes, name: str = "corpus.txt") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def _stream(n: int) -> bytes:
    """n bytes cycling through 0..250 (251 is prime to the window of 8: windows differ)."""
    return bytes(i % 251 for i in range(n))


def _windows(batch: tuple[Any, Any]) -> torch.Tensor:
    inputs, targets = batch
    return torch.cat([inputs, targets[:, -1:]], dim=1)


# -- packing ------------------------------------------------------------------------------


def test_each_row_is_the_sampled_window_of_t_plus_one_tokens_shifted_by_one(
    tmp_path: Path,
) -> None:
    tokens = _stream(8 * 13 + 5)  # 13 windows and a 5-byte tail
    hook = text_hook(_corpus(tmp_path, tokens), example=_example())
    ctx = _ctx()
    order = ctx.sampler(13)  # 12 rows: 3 global batches of 4
    batches = list(hook(ctx))
    assert len(batches) == 3
    stream = torch.tensor(list(tokens))
    for g, (inputs, targets) in enumerate(batches):
        for row in range(B):
            w = order[g * B + row]
            window = stream[w * 8 : (w + 1) * 8]
            assert torch.equal(inputs[row], window[:-1])
            assert torch.equal(targets[row], window[1:])


def test_windows_never_overlap_nor_reach_into_the_tail(tmp_path: Path) -> None:
    # Every window holds distinct bytes 0..103; the tail is 255s, which no row may read.
    tokens = bytes(range(8 * 13)) + b"\xff" * 7
    hook = text_hook(_corpus(tmp_path, tokens), example=_example())
    rows = torch.cat([_windows(b) for b in hook(_ctx())])
    assert not (rows == 255).any()
    starts = sorted(int(r[0]) for r in rows)
    assert len(set(starts)) == len(starts) == 12
    assert all(s % 8 == 0 for s in starts)  # aligned on T + 1: packed, not overlapping
    assert all(torch.equal(r, torch.arange(r[0], r[0] + 8)) for r in rows)


def test_byte_level_tokens_are_the_files_bytes(tmp_path: Path) -> None:
    text = "naïve café — ünïcødé ok".encode() * 4
    hook = text_hook(_corpus(tmp_path, text), example=_example())
    ctx = _ctx()
    order = ctx.sampler(len(text) // 8)
    first = _windows(next(iter(hook(ctx))))
    assert bytes(first[0].tolist()) == text[order[0] * 8 : order[0] * 8 + 8]
    assert int(first.max()) > 127  # UTF-8's multi-byte sequences come through as bytes


def _tokenizer(tmp_path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(
        LINES, trainers.WordLevelTrainer(special_tokens=["[UNK]"], show_progress=False)
    )
    folder = tmp_path / "tok"
    folder.mkdir()
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


@pytest.mark.parametrize("as_file", [False, True], ids=["directory", "tokenizer.json"])
def test_tokenizer_level_tokens_are_the_tokenizers_ids(tmp_path: Path, as_file: bool) -> None:
    pytest.importorskip("tokenizers", reason="tokenizers comes with transformers (test extra)")
    from tokenizers import Tokenizer

    folder = _tokenizer(tmp_path)
    text = "\n".join(LINES * 6)
    path = _corpus(tmp_path, text.encode())
    given = folder / "tokenizer.json" if as_file else folder
    hook = text_hook(path, tokenizer=given, example=_example())
    ids = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text).ids
    ctx = _ctx()
    order = ctx.sampler(len(ids) // 8)
    rows = torch.cat([_windows(b) for b in hook(ctx)])
    assert len(rows) == len(ids) // 8 // B * B
    for row, w in zip(rows, order, strict=False):
        assert row.tolist() == ids[w * 8 : (w + 1) * 8]
    assert int(rows.max()) < 20  # word ids, not bytes


def test_text_is_cut_into_pieces_after_a_newline_and_nothing_is_lost(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(text_data, "_PIECE", 10)
    text = "ab\ncdefgh\nij\n" + "k" * 25 + "\nlm"
    pieces = text_data._pieces(text)
    assert "".join(pieces) == text
    assert pieces == ["ab\ncdefgh\n", "ij\n", "k" * 10, "k" * 10, "kkkkk\nlm"]
    assert text_data._pieces("") == []


def test_pieces_tokenize_as_the_whole_text_at_line_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("tokenizers", reason="tokenizers comes with transformers (test extra)")
    from tokenizers import Tokenizer

    monkeypatch.setattr(text_data, "_PIECE", 30)  # one line or two per piece
    monkeypatch.setattr(text_data, "_BATCH", 3)
    folder = _tokenizer(tmp_path)
    text = "\n".join(LINES * 6)
    tokens = text_hook(_corpus(tmp_path, text.encode()), tokenizer=folder, example=_example())
    whole = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text).ids
    assert len(text_data._pieces(text)) > 10
    assert tokens.tokens().tolist() == whole


# -- the example's form -------------------------------------------------------------------


@pytest.mark.parametrize(
    "inputs",
    [
        torch.zeros(B, T, dtype=torch.int32),
        {"input_ids": torch.zeros(B, T, dtype=torch.int32)},
        (torch.zeros(B, T, dtype=torch.int32),),
        [torch.zeros(B, T, dtype=torch.int32)],
    ],
    ids=["tensor", "dict", "tuple", "list"],
)
def test_batches_take_the_examples_structure_and_dtypes(tmp_path: Path, inputs: Any) -> None:
    targets = torch.zeros(B, T, dtype=torch.int16)
    hook = text_hook(_corpus(tmp_path, _stream(100)), example=(inputs, targets))
    x, y = next(iter(hook(_ctx(dp_size=2))))
    assert type(x) is type(inputs)
    tensor = (
        x if isinstance(x, torch.Tensor) else next(iter(x.values() if isinstance(x, dict) else x))
    )
    if isinstance(x, dict):
        assert list(x) == ["input_ids"]
    assert (tensor.shape, tensor.dtype) == ((2, T), torch.int32)
    assert (y.shape, y.dtype) == ((2, T), torch.int16)
    assert torch.equal(tensor[:, 1:].long(), y[:, :-1].long())


# -- ranks and epochs ---------------------------------------------------------------------


@pytest.mark.parametrize("dp", [2, 4])
def test_dp_shares_concatenate_to_the_dp1_global_batch_in_order(tmp_path: Path, dp: int) -> None:
    hook = text_hook(_corpus(tmp_path, _stream(8 * 30)), example=_example())
    whole = list(hook(_ctx()))
    shares = [list(hook(_ctx(dp_rank=d, dp_size=dp))) for d in range(dp)]
    assert all(len(s) == len(whole) == 7 for s in shares)
    for step, (inputs, targets) in enumerate(whole):
        assert torch.equal(torch.cat([s[step][0] for s in shares]), inputs)
        assert torch.equal(torch.cat([s[step][1] for s in shares]), targets)


def test_epochs_differ_and_each_is_the_same_every_time(tmp_path: Path) -> None:
    path = _corpus(tmp_path, _stream(8 * 28))  # 7 whole global batches: no window dropped
    hook = text_hook(path, example=_example())
    first = torch.cat([_windows(b) for b in hook(_ctx(epoch=0))])
    second = torch.cat([_windows(b) for b in hook(_ctx(epoch=1))])
    text_data._tokens.cache_clear()  # read afresh: the order does not hang on the cache
    again = torch.cat([_windows(b) for b in text_hook(path, example=_example())(_ctx(epoch=0))])
    assert torch.equal(first, again)
    assert not torch.equal(first, second)
    # The same windows in another order: an epoch is a permutation of them.
    assert sorted(first[:, 0].tolist()) == sorted(second[:, 0].tolist())


@pytest.mark.parametrize(
    ("flags", "has_inputs", "has_targets"),
    [
        ({"needs_inputs": False}, False, True),
        ({"needs_targets": False}, True, False),
        ({}, True, True),
    ],
    ids=["last-stage", "first-stage", "both"],
)
def test_a_rank_gets_none_for_what_it_does_not_need(
    tmp_path: Path, flags: dict[str, bool], has_inputs: bool, has_targets: bool
) -> None:
    hook = text_hook(_corpus(tmp_path, _stream(100)), example=_example())
    batches = list(hook(_ctx(**flags)))
    assert len(batches) == 3  # as many batches as every other rank yields
    for inputs, targets in batches:
        assert (inputs is not None) == has_inputs
        assert (targets is not None) == has_targets


def test_the_file_is_tokenized_once_per_process_and_again_when_it_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("tokenizers", reason="tokenizers comes with transformers (test extra)")
    calls: list[Path] = []
    encode = text_data._encode

    def counted(path: Path, tokenizer: Any) -> torch.Tensor:
        calls.append(path)
        return encode(path, tokenizer)

    monkeypatch.setattr(text_data, "_encode", counted)
    folder = _tokenizer(tmp_path)
    path = _corpus(tmp_path, "\n".join(LINES * 6).encode())
    hook = text_hook(path, tokenizer=folder, example=_example())
    assert calls == []  # making the hook loads nothing: ranks needing no data never read
    for epoch in range(3):
        list(hook(_ctx(epoch=epoch)))
        list(text_hook(path, tokenizer=folder, example=_example())(_ctx(dp_size=2)))
    assert len(calls) == 1
    path.write_bytes("\n".join(LINES[::-1] * 6).encode())  # the same size
    os.utime(path, ns=(1, 1))  # a new modification time, whatever the clock's resolution
    list(hook(_ctx()))
    assert len(calls) == 2


# -- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("example", "seen"),
    [
        ((torch.zeros(B, T), torch.zeros(B, T, dtype=torch.long)), "torch.float32"),
        (
            (torch.zeros(B, T, 3, dtype=torch.long), torch.zeros(B, T, dtype=torch.long)),
            "(4, 7, 3)",
        ),
        ((torch.zeros(B, T, dtype=torch.long), torch.zeros(B, dtype=torch.long)), "shape (4,)"),
        ((torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T + 1, dtype=torch.long)), "(4, 8)"),
        ((torch.zeros(B, T, dtype=torch.bool), torch.zeros(B, T, dtype=torch.long)), "torch.bool"),
        (
            (
                {"input_ids": torch.zeros(B, T, dtype=torch.long), "mask": torch.ones(B, T)},
                torch.zeros(B, T, dtype=torch.long),
            ),
            "'mask'",
        ),
        (
            ((torch.zeros(B, T, dtype=torch.long),) * 2, torch.zeros(B, T, dtype=torch.long)),
            "tuple",
        ),
    ],
    ids=["float", "3d", "targets-1d", "seq-mismatch", "bool", "two-entries", "two-items"],
)
def test_an_example_that_is_not_token_ids_is_refused_naming_what_it_has(
    example: tuple[Any, Any], seen: str
) -> None:
    with pytest.raises(ParcError, match="one integer \\(batch, seq\\) input") as info:
        batch_form(example)
    assert seen in str(info.value)


def test_a_missing_file_a_directory_and_an_empty_file_are_errors(tmp_path: Path) -> None:
    empty = _corpus(tmp_path, b"", "empty.txt")
    for path, words in (
        (tmp_path / "nope.txt", "no such file"),
        (tmp_path, "not a file"),
        (empty, "the file is empty"),
    ):
        with pytest.raises(ParcError, match=words) as info:
            text_hook(path, example=_example())
        assert str(path) in str(info.value)
        assert info.value.hint and "--data" in info.value.hint


def test_an_unreadable_file_is_an_error_not_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _corpus(tmp_path, _stream(100))

    def refuse(self: Path, *args: Any, **kwargs: Any) -> Any:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "open", refuse)  # root reads any file: refuse the open itself
    with pytest.raises(ParcError, match="cannot be read \\(Permission denied\\)"):
        text_hook(path, example=_example())


def test_a_byte_corpus_shorter_than_one_global_batch_is_refused_up_front(tmp_path: Path) -> None:
    path = _corpus(tmp_path, _stream(8 * B - 1))
    with pytest.raises(ParcError) as info:
        text_hook(path, example=_example())
    message = str(info.value)
    assert str(path.resolve()) in message
    assert "31 tokens" in message and "needs 32 tokens" in message
    text_hook(_corpus(tmp_path, _stream(8 * B), "enough.txt"), example=_example())


def test_a_tokenized_corpus_shorter_than_one_global_batch_is_refused(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers", reason="tokenizers comes with transformers (test extra)")
    folder = _tokenizer(tmp_path)
    path = _corpus(tmp_path, " ".join(LINES).encode())  # 21 words: 2 windows of 8
    hook = text_hook(path, tokenizer=folder, example=_example())
    with pytest.raises(ParcError, match=r"21 tokens .* make 2 windows .* needs 32 tokens"):
        hook(_ctx())


def test_token_ids_the_model_cannot_take_are_refused_before_training(tmp_path: Path) -> None:
    path = _corpus(tmp_path, b"abc\xe2\x80\x94" * 20)  # an em dash: bytes up to 0xe2 = 226
    # Bytes past a smaller vocabulary: found when the hook is made, before any rank trains.
    with pytest.raises(ParcError, match="reach 226, and the model takes ids below 128"):
        text_hook(path, example=_example(), vocab=128)
    assert list(text_hook(path, example=_example(), vocab=227)(_ctx()))
    narrow = _example(dtype=torch.int8)
    with pytest.raises(ParcError, match=r"reach 226, beyond what .*torch\.int8"):
        text_hook(path, example=narrow)(_ctx())
    ascii_only = _corpus(tmp_path, b"abc" * 40, "ascii.txt")
    assert list(text_hook(ascii_only, example=narrow)(_ctx()))


def test_bytes_are_scanned_for_their_largest_id_only_when_a_limit_is_below_256(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    scanned: list[Path] = []
    top = text_data._top.__wrapped__

    def counted(path: Path, *key: Any) -> int:
        scanned.append(path)
        return top(path, *key)

    monkeypatch.setattr(text_data, "_top", counted)
    path = _corpus(tmp_path, _stream(100))
    list(text_hook(path, example=_example(), vocab=256)(_ctx()))
    list(text_hook(path, example=_example(dtype=torch.uint8))(_ctx()))
    assert scanned == []  # a memory-mapped corpus is read only where windows are taken
    list(text_hook(path, example=_example(), vocab=255)(_ctx()))
    # Once when the hook is made, once on its call (the real `_top` caches: one read).
    assert scanned == [path.resolve()] * 2


def test_a_tokenizer_with_more_ids_than_the_model_takes_is_refused(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers", reason="tokenizers comes with transformers (test extra)")
    folder = _tokenizer(tmp_path)
    from tokenizers import Tokenizer

    size = Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size()
    path = _corpus(tmp_path, " ".join(LINES * 4).encode())
    with pytest.raises(ParcError, match=rf"has {size} token ids and the model takes ids below"):
        text_hook(path, tokenizer=folder, example=_example(), vocab=size - 1)
    assert text_hook(path, tokenizer=folder, example=_example(), vocab=size).vocab == size


def test_a_missing_or_broken_tokenizer_is_an_error(tmp_path: Path) -> None:
    path = _corpus(tmp_path, _stream(100))
    folder = tmp_path / "empty-dir"
    folder.mkdir()
    broken = _corpus(tmp_path, b"{not json", "tokenizer.json")
    for given, words in (
        (tmp_path / "nope.json", "no such file"),
        (folder, "no tokenizer.json in it"),
        (broken, "not a tokenizer the tokenizers library can load"),
    ):
        with pytest.raises(ParcError, match=words) as info:
            text_hook(path, tokenizer=given, example=_example())
        assert str(given) in str(info.value)


def test_without_the_tokenizers_library_the_error_gives_the_pip_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("tokenizers", reason="tokenizers comes with transformers (test extra)")
    folder = _tokenizer(tmp_path)
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers fails
    text_data._load_tokenizer.cache_clear()
    with pytest.raises(ParcError, match="needs the `tokenizers` library") as info:
        text_hook(_corpus(tmp_path, _stream(100)), tokenizer=folder, example=_example())
    assert info.value.hint and "pip install tokenizers" in info.value.hint
    text_data._load_tokenizer.cache_clear()
    assert list(text_hook(_corpus(tmp_path, _stream(100)), example=_example())(_ctx()))


def test_a_file_that_is_not_utf8_is_refused_at_the_tokenizer_level_only(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers", reason="tokenizers comes with transformers (test extra)")
    folder = _tokenizer(tmp_path)
    path = _corpus(tmp_path, b"the cat " * 10 + b"\xff" + b" sat" * 40)
    with pytest.raises(ParcError, match="byte 80 is not UTF-8"):
        text_hook(path, tokenizer=folder, example=_example())(_ctx())
    assert list(text_hook(path, example=_example())(_ctx()))  # bytes are bytes


def test_the_demo_corpus_is_parcs_own_architecture_page() -> None:
    path = demo_corpus()
    assert path == (Path(__file__).resolve().parent.parent / "docs" / "architecture.md")
    hook = text_hook(path, example=_example(batch=8, seq=64))
    batches = list(hook(DataContext.whole(8)))
    assert len(batches) == path.stat().st_size // 65 // 8
    text = path.read_bytes()
    assert all(bytes(row.tolist()) in text for row in _windows(batches[0]))
