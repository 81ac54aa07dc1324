"""The text-file dataset: what `parc run ... --data corpus.txt` trains on.

    hook = text_hook("corpus.txt", example=(inputs, targets))   # the traced batch
    for inputs, targets in hook(ctx):                          # this rank's batches
        program.step_local(inputs, targets)

The file becomes one stream of tokens: its bytes (0..255) by default, or the ids of
a local Hugging Face tokenizer (`tokenizer=` a directory holding `tokenizer.json`,
or that file; loaded with the `tokenizers` library, no network). The stream is cut
into non-overlapping windows of T + 1 tokens, T the example's sequence length
(its inputs' dim 1): window w is tokens[w(T+1) : (w+1)(T+1)], its inputs the first
T tokens, its targets the last T, so every window is one packed training row and
none crosses the end of the stream (the last len % (T+1) tokens are never read).
Documents are not separated: a window may join the end of one paragraph to the
next, as a packed corpus does.

Algorithm:

1. `text_hook` reads the example batch's form (`batch_form`): one integer
   (batch, T) input (a tensor, or the one entry of a dict, tuple or list) and integer
   (batch, T) targets; anything else is a `ParcError` naming what it has. It
   checks the file (exists, is a file, can be opened, is not empty) and loads
   the tokenizer, so a mistake is found before any rank trains; at the byte
   level the file's size already says whether one global batch of windows fits.
2. `hook(ctx)` tokenizes the file once per process (`_tokens`, cached; bytes
   are memory-mapped, not read; text is encoded in pieces that end after a
   newline, `_pieces`) and checks the corpus holds one global batch of
   windows and, with `vocab`, that no token id reaches it. Only ranks that call
   the hook load: parc's data stream never calls it on a rank needing neither
   inputs nor targets.
3. The windows of epoch `ctx.epoch` are `ctx.sampler(num_windows)`'s indices:
   the rank's share of each global batch, in order, so the shares of every dp
   rank concatenate to the dp=1 batch. Each batch is gathered from the token
   stream, inputs and targets cast to the example's dtypes and put in its
   structure; what the rank does not need (`ctx.needs_inputs`,
   `ctx.needs_targets`) is None.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from parc.compiler.data_context import DataContext
from parc.errors import ParcError

__all__ = ["BatchForm", "TextData", "batch_form", "demo_corpus", "text_hook"]

Batch = tuple[Any, Any]
_NEEDS = (
    "--data needs a model whose example batch is one integer (batch, seq) input plus "
    "(batch, seq) integer targets"
)
_BYTES = 256  # byte-level token ids are 0..255


@dataclass(frozen=True, slots=True)
class BatchForm:
    """The shape of a batch as the traced example has it.

    `key` says where the one input tensor sits: None for a bare tensor, a str for
    a dict's key, an int for a tuple's position (`container` is then tuple or list).
    """

    batch: int
    seq: int
    input_dtype: torch.dtype
    target_dtype: torch.dtype
    key: str | int | None = None
    container: type = tuple

    def inputs(self, tokens: torch.Tensor) -> Any:
        """(rows, seq) token ids as the model takes its inputs."""
        x = tokens.to(self.input_dtype)
        if self.key is None:
            return x
        if isinstance(self.key, str):
            return {self.key: x}
        return self.container([x])

    @property
    def widest(self) -> int:
        """The largest token id both dtypes can hold."""
        return min(torch.iinfo(self.input_dtype).max, torch.iinfo(self.target_dtype).max)


def batch_form(example: Batch) -> BatchForm:
    """The `BatchForm` of `example` = (inputs, targets), or a ParcError naming what it has."""
    inputs, targets = example
    key: str | int | None = None
    container: type = tuple
    if isinstance(inputs, Mapping) and len(inputs) == 1:
        key, tensor = next(iter(inputs.items()))
    elif isinstance(inputs, tuple | list) and len(inputs) == 1:
        key, tensor, container = 0, inputs[0], type(inputs)
    else:
        tensor = inputs
    if not (_is_ids(tensor) and _is_ids(targets) and tensor.shape == targets.shape):
        raise ParcError(
            f"{_NEEDS}; this model's example batch has inputs {_describe(inputs)} and "
            f"targets {_describe(targets)}",
            hint="give such a model (e.g. examples/gpt.py), or leave --data out and train "
            "on the model file's own sample_batch or data(ctx)",
        )
    batch, seq = tensor.shape
    return BatchForm(batch, seq, tensor.dtype, targets.dtype, key, container)


def _is_ids(value: Any) -> bool:
    integer = isinstance(value, torch.Tensor) and not (
        value.is_floating_point() or value.is_complex() or value.dtype == torch.bool
    )
    return integer and value.dim() == 2


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    if isinstance(value, Mapping):
        return "a dict {" + ", ".join(f"{k!r}: {_describe(v)}" for k, v in value.items()) + "}"
    if isinstance(value, tuple | list):
        return f"a {type(value).__name__} ({', '.join(_describe(v) for v in value)})"
    return f"a {type(value).__name__}"


@dataclass(frozen=True, slots=True)
class TextData:
    """The `data(ctx)` hook of a text file (made by `text_hook`)."""

    path: Path
    form: BatchForm
    tokenizer: Path | None = None
    vocab: int | None = None

    def __call__(self, ctx: DataContext) -> Iterator[Batch]:
        tokens = self.tokens()
        window = self.form.seq + 1
        count = len(tokens) // window
        if count < ctx.global_batch:
            raise self._too_short(len(tokens), ctx.global_batch)
        # The rank's rows of each global batch, one after the other: ctx.batch at a time.
        rows = torch.tensor(ctx.sampler(count, shuffle=True), dtype=torch.long)
        shares = rows.view(-1, ctx.batch)
        return self._batches(tokens, shares, ctx.needs_inputs, ctx.needs_targets)

    def tokens(self) -> torch.Tensor:
        """The file's token stream (one dim), checked against `vocab` and the dtypes."""
        key = _cache_key(self.path, self.tokenizer)
        below = min(self.vocab or _BYTES, self.form.widest + 1)  # every id must be below it
        if self.tokenizer is not None or below < _BYTES:  # bytes are below 256: no need to look
            self._check_ids(_top(*key))
        return _tokens(*key)

    def _batches(
        self, tokens: torch.Tensor, shares: torch.Tensor, inputs: bool, targets: bool
    ) -> Iterator[Batch]:
        offsets = torch.arange(self.form.seq + 1)
        for rows in shares:
            windows = tokens[rows[:, None] * (self.form.seq + 1) + offsets].long()
            yield (
                self.form.inputs(windows[:, :-1]) if inputs else None,
                windows[:, 1:].to(self.form.target_dtype) if targets else None,
            )

    def _level(self) -> str:
        return f"tokenizer {self.tokenizer}" if self.tokenizer else "bytes"

    def _too_short(self, have: int, batch: int) -> ParcError:
        window = self.form.seq + 1
        return ParcError(
            f"--data {self.path}: {have} tokens ({self._level()}) make {have // window} "
            f"windows of {window} (sequence {self.form.seq} + 1); one global batch of {batch} "
            f"needs {batch * window} tokens",
            hint="give a longer text file, or a smaller --batch or sequence length",
        )

    def _check_tokenizer_size(self, size: int) -> None:
        if self.vocab is not None and size > self.vocab:
            raise ParcError(
                f"--tokenizer {self.tokenizer} has {size} token ids and the model takes ids "
                f"below {self.vocab} (the rows of the embedding its inputs index)",
                hint=f"use a tokenizer of at most {self.vocab} ids, or a model whose "
                f"vocabulary is at least {size}",
            )

    def _check_ids(self, top: int) -> None:
        if self.vocab is not None and top >= self.vocab:
            raise ParcError(
                f"--data {self.path}: its token ids ({self._level()}) reach {top}, and the "
                f"model takes ids below {self.vocab} (the rows of the embedding its inputs "
                "index)",
                hint=f"use a model whose vocabulary is at least {top + 1} (bytes need "
                f"{_BYTES}), or a --tokenizer whose vocabulary fits the model",
            )
        if top > self.form.widest:
            raise ParcError(
                f"--data {self.path}: its token ids ({self._level()}) reach {top}, beyond what "
                f"the example batch's dtypes ({self.form.input_dtype}, "
                f"{self.form.target_dtype}) hold",
                hint="make the model's example inputs and targets int64 (e.g. `.long()`)",
            )


def text_hook(
    path: str | Path,
    *,
    tokenizer: str | Path | None = None,
    example: Batch,
    vocab: int | None = None,
) -> TextData:
    """The `data(ctx)` hook for the text file `path`, packed to `example`'s sequence length.

    `example` is the model's traced (inputs, targets) at the global batch; `vocab`
    (optional) the ids the model's inputs may hold (compiler/input_vocab.py), so a
    token id it cannot take is an error here (a tokenizer with more ids, bytes past
    a smaller vocabulary) instead of inside the embedding at the first step.
    """
    form = batch_form(example)
    data = TextData(_checked_file(Path(path)), form, _tokenizer_file(tokenizer), vocab)
    if data.tokenizer is not None:
        # A broken tokenizer fails here, before any step; so does one with more ids than
        # the model takes (it may produce any of them).
        data._check_tokenizer_size(_load_tokenizer(data.tokenizer).get_vocab_size())
    else:
        if (size := data.path.stat().st_size) // (form.seq + 1) < form.batch:
            raise data._too_short(size, form.batch)  # bytes: the size is the token count
        if vocab is not None and vocab < _BYTES:
            data._check_ids(_top(*_cache_key(data.path, None)))
    return data


def _checked_file(path: Path) -> Path:
    """`path` resolved, if it is a readable non-empty file, else a ParcError with the fix."""
    fix = "give --data the path of a text file (e.g. --data docs/architecture.md)"
    if not path.exists():
        raise ParcError(f"--data {path}: no such file", hint=fix)
    if not path.is_file():
        raise ParcError(f"--data {path}: not a file", hint=fix)
    try:
        with path.open("rb") as f:
            empty = not f.read(1)
    except OSError as exc:
        why = exc.strerror or str(exc)
        raise ParcError(f"--data {path}: cannot be read ({why})", hint=fix) from exc
    if empty:
        raise ParcError(f"--data {path}: the file is empty", hint=fix)
    return path.resolve()


def _tokenizer_file(tokenizer: str | Path | None) -> Path | None:
    if tokenizer is None:
        return None
    path = Path(tokenizer)
    found = path / "tokenizer.json" if path.is_dir() else path
    if not found.is_file():
        raise ParcError(
            f"--tokenizer {path}: {'no tokenizer.json in it' if path.is_dir() else 'no such file'}",
            hint="give a local Hugging Face tokenizer: a directory holding tokenizer.json "
            "(e.g. a model downloaded with its tokenizer) or that file; nothing is downloaded",
        )
    return found.resolve()


@functools.lru_cache(maxsize=4)
def _load_tokenizer(path: Path) -> Any:
    """A `tokenizers.Tokenizer` from `path`, or a ParcError saying why not."""
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:
        raise ParcError(
            "--tokenizer needs the `tokenizers` library, which is not installed",
            hint="pip install tokenizers (it comes with transformers), or leave --tokenizer "
            "out to train on bytes",
        ) from exc
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception for a malformed file
        raise ParcError(
            f"--tokenizer {path}: not a tokenizer the tokenizers library can load ({exc})",
            hint="give the tokenizer.json a Hugging Face tokenizer saves (tokenizer.save)",
        ) from exc


def _cache_key(path: Path, tokenizer: Path | None) -> tuple[Path, Path | None, int, int]:
    """The file and its size and time: a file changed since it was read is read again."""
    stat = path.stat()
    return path, tokenizer, stat.st_size, stat.st_mtime_ns


@functools.lru_cache(maxsize=4)
def _tokens(path: Path, tokenizer: Path | None, size: int, mtime_ns: int) -> torch.Tensor:
    """The token stream of `path`.

    Bytes are memory-mapped (copy-on-write, so torch gets a writable array; pages
    are read when indexed); a tokenizer's ids are int32.
    """
    del mtime_ns  # only part of the cache key
    if tokenizer is None and not size:
        return torch.empty(0, dtype=torch.uint8)  # emptied since text_hook checked it
    if tokenizer is None:
        return torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="c"))
    return _encode(path, _load_tokenizer(tokenizer))


@functools.lru_cache(maxsize=4)
def _top(path: Path, tokenizer: Path | None, size: int, mtime_ns: int) -> int:
    """The largest token id of `path` (-1 when it has none): one pass over the stream."""
    tokens = _tokens(path, tokenizer, size, mtime_ns)
    return int(tokens.max()) if len(tokens) else -1


def _encode(path: Path, tokenizer: Any) -> torch.Tensor:
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ParcError(
            f"--data {path}: byte {exc.start} is not UTF-8 ({exc.reason}); a tokenizer reads text",
            hint="convert the file to UTF-8 (e.g. iconv -t utf-8), or leave --tokenizer out "
            "to train on its bytes",
        ) from exc
    pieces = _pieces(text)
    ids = [
        torch.tensor(encoding.ids, dtype=torch.int32)
        for start in range(0, len(pieces), _BATCH)
        for encoding in tokenizer.encode_batch(
            pieces[start : start + _BATCH], add_special_tokens=False
        )
    ]
    return torch.cat(ids) if ids else torch.empty(0, dtype=torch.int32)


# Text is encoded a piece at a time: one encode of a whole 10 MB file (a BPE of 2,000
# ids, 3.1 M tokens) raised the process' peak RSS by 1,682 MiB in 10.3 s, as an Encoding
# keeps each token's string and offsets besides its id; in 64 Ki-character pieces, 4 at
# a time, by 128 MiB in 6.6 s (~50 MiB of it the file's bytes, its text and its ids).
_PIECE = 1 << 16  # characters per piece, cut after a newline
_BATCH = 4  # pieces encoded together (encode_batch runs them on threads)


def _pieces(text: str) -> list[str]:
    """`text` in pieces of at most `_PIECE` characters, each ending after a newline when
    one is in reach (a line longer than a piece is cut inside).

    Each piece is encoded on its own, so no token spans two: a pre-tokenizer that joins
    a newline to the next line's indentation (GPT-2's byte level) splits that one run
    of whitespace in two where a piece ends, once per ~64 Ki characters.
    """
    pieces, start = [], 0
    while start < len(text):
        end = start + _PIECE
        if end < len(text) and (cut := text.rfind("\n", start, end)) >= start:
            end = cut + 1
        pieces.append(text[start:end])
        start = end
    return pieces


def demo_corpus(root: Path | None = None) -> Path:
    """`docs/architecture.md` of the parc checkout at `root` (default: this one).

    parc's own architecture page, ~70 KB of English and code names written for
    this project: a corpus for `make demo` that needs no download.
    """
    base = root if root is not None else Path(__file__).resolve().parent.parent
    return _checked_file(base / "docs" / "architecture.md")
