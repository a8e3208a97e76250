"""Offline token data: the default corpus, user text files and nanoGPT-style token files.

Nothing is downloaded. The default corpus is the bytes of the running interpreter's standard-library
``.py`` files (a fixed, sorted list; vocabulary 256), which exists wherever the project runs: its
first 8 MiB by default, all of it (about 30 MiB) as ``stdlib-all``; its size and sha256 identify it
in every result. Batches are a pure function of ``(seed, step)``, so a resumed run sees exactly the
batches an uninterrupted one would. Two samplings of the training split: ``random`` (each window
at an offset drawn afresh, so a token may be seen more than once) and ``single-pass`` (the split cut
into disjoint windows, visited in a seeded random order without repetition: no training token is
predicted twice, as in pretraining on a corpus seen once).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import pathlib
import sysconfig

import numpy as np

DEFAULT_CORPUS_BYTES = 8 * 2**20  # the first 8 MiB of the sorted file list
WHOLE_STDLIB = "stdlib-all"  # ``load``'s name for every standard-library file (no byte limit)
SAMPLINGS = ("random", "single-pass")


@functools.lru_cache(maxsize=8)
def _visit_order(num_windows: int, seed: int) -> np.ndarray:
  """The order in which ``single-pass`` visits a split's windows: a permutation seeded by ``seed``."""
  return np.random.default_rng([seed, num_windows, 2]).permutation(num_windows)


@dataclasses.dataclass(frozen=True)
class Dataset:
  """Token arrays for training and validation.

  Attributes:
    train: 1-D integer array of training tokens.
    valid: 1-D integer array of validation tokens.
    vocab_size: number of distinct token ids the model must embed.
    name: where the tokens came from.
    sha256: hash of the source bytes.
  """

  train: np.ndarray
  valid: np.ndarray
  vocab_size: int
  name: str
  sha256: str

  @property
  def num_tokens(self) -> int:
    return len(self.train) + len(self.valid)

  def batch(self, seed: int, step: int, batch_size: int, context: int, split: str = "train",
            sampling: str = "random"):
    """Batch ``step`` of the stream ``seed``: ``(inputs, targets)`` int32 arrays (batch, context).

    A pure function of its arguments. ``random``: windows start at offsets drawn from a NumPy
    generator seeded with ``(seed, step, split)``. ``single-pass`` (training split only): window
    ``i`` of the split is ``tokens[i * context : (i + 1) * context + 1]`` (each token a target
    once), and step ``s`` takes windows ``s * batch_size ..`` of the seeded visiting order.
    """
    tokens = {"train": self.train, "valid": self.valid}[split]
    if sampling == "single-pass" and split == "train":
      order = _visit_order(self.windows(context), seed)
      picked = order[step * batch_size:(step + 1) * batch_size]
      if len(picked) < batch_size:
        raise ValueError(f"single-pass step {step} needs windows past the training split's "
                         f"{len(order)} of {context} tokens: {self.name} would repeat tokens")
      starts = picked * context
    elif sampling in SAMPLINGS:
      rng = np.random.default_rng([seed, step, 0 if split == "train" else 1])
      starts = rng.integers(0, len(tokens) - context - 1, size=batch_size)
    else:
      raise ValueError(f"unknown sampling {sampling!r}; choose from {SAMPLINGS}")
    windows = np.stack([np.asarray(tokens[s:s + context + 1]) for s in starts]).astype(np.int32)
    return windows[:, :-1], windows[:, 1:]

  def windows(self, context: int) -> int:
    """Disjoint windows of ``context`` targets the training split holds (``single-pass``)."""
    return (len(self.train) - 1) // context

  def check_single_pass(self, steps: int, batch_size: int, context: int) -> None:
    """An error, naming both numbers, unless ``steps`` steps of ``batch_size`` windows fit in one
    pass over the training split."""
    if steps * batch_size > self.windows(context):
      raise ValueError(f"single-pass sampling: {steps} steps of {batch_size} windows of {context} tokens "
                       f"need {steps * batch_size} windows, but {self.name}'s training split holds "
                       f"{self.windows(context)}: choose fewer steps or a larger corpus")

  def batches(self, seed: int, first_step: int, num_steps: int, batch_size: int, context: int,
              sampling: str = "random"):
    """Batches ``first_step .. first_step + num_steps - 1`` stacked on a leading axis."""
    xs, ys = zip(*(self.batch(seed, first_step + i, batch_size, context, sampling=sampling)
                   for i in range(num_steps)))
    return np.stack(xs), np.stack(ys)


def _split(tokens: np.ndarray, valid_fraction: float, context: int, name: str):
  n_valid = int(len(tokens) * valid_fraction)
  need = 2 * (context + 2)
  train, valid = tokens[:len(tokens) - n_valid], tokens[len(tokens) - n_valid:]
  if min(len(train), len(valid)) < context + 2:
    raise ValueError(
        f"{name} has {len(tokens)} tokens: too short for context {context} with a "
        f"{valid_fraction:.0%} validation split (need at least {need} tokens in each split, "
        f"about {int(need / max(valid_fraction, 1e-9))} in all)")
  return train, valid


def stdlib_files() -> list[pathlib.Path]:
  """The standard library's ``.py`` files in sorted order (site-packages excluded)."""
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  return sorted(p for p in root.rglob("*.py")
                if "site-packages" not in p.parts and "dist-packages" not in p.parts and p.is_file())


def default_corpus_bytes(max_bytes: int | None = DEFAULT_CORPUS_BYTES) -> bytes:
  """The first ``max_bytes`` (``None``: all) of the concatenated standard-library ``.py`` files."""
  chunks, size = [], 0
  for path in stdlib_files():
    data = path.read_bytes()
    chunks.append(data if max_bytes is None else data[:max_bytes - size])
    size += len(chunks[-1])
    if max_bytes is not None and size >= max_bytes:
      break
  raw = b"".join(chunks)
  if not raw:
    raise ValueError(f"no standard-library .py files found under {sysconfig.get_paths()['stdlib']}")
  return raw


def default_corpus(context: int, valid_fraction: float = 0.1,
                   max_bytes: int | None = DEFAULT_CORPUS_BYTES) -> Dataset:
  """The default corpus: standard-library source bytes, vocabulary 256 (``max_bytes=None``: every
  file, named ``...-stdlib-all``)."""
  raw = default_corpus_bytes(max_bytes)
  tokens = np.frombuffer(raw, dtype=np.uint8)
  train, valid = _split(tokens, valid_fraction, context, "the default corpus")
  suffix = "-all" if max_bytes is None else ""
  return Dataset(train, valid, 256, f"python{sysconfig.get_python_version()}-stdlib{suffix}",
                 hashlib.sha256(raw).hexdigest())


def _check_file(path) -> pathlib.Path:
  path = pathlib.Path(path)
  if path.is_dir():
    raise ValueError(f"data path {str(path)!r} is a folder; give a text file or a .bin token file")
  if not path.is_file():
    raise FileNotFoundError(f"data file {str(path)!r} does not exist")
  if path.stat().st_size == 0:
    raise ValueError(f"data file {str(path)!r} is empty")
  try:
    with open(path, "rb") as f:
      f.read(1)
  except OSError as e:
    raise ValueError(f"data file {str(path)!r} cannot be read: {e.strerror or e}") from None
  return path


def _sha256(path: pathlib.Path) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(2**20), b""):
      digest.update(block)
  return digest.hexdigest()


def text_file(path, context: int, valid_fraction: float = 0.1) -> Dataset:
  """A text (any bytes) file as byte tokens, vocabulary 256."""
  path = _check_file(path)
  tokens = np.fromfile(path, dtype=np.uint8)
  train, valid = _split(tokens, valid_fraction, context, f"data file {str(path)!r}")
  return Dataset(train, valid, 256, str(path), _sha256(path))


def token_file(path, context: int, vocab_size: int, valid_fraction: float = 0.1) -> Dataset:
  """A nanoGPT-style ``.bin`` file of uint16 token ids (memory-mapped)."""
  path = _check_file(path)
  if path.stat().st_size % 2:
    raise ValueError(f"token file {str(path)!r} has an odd size: not a uint16 array")
  if not 1 <= vocab_size <= 2**16:
    raise ValueError(f"vocab_size for a uint16 token file must be in [1, 65536], got {vocab_size}")
  tokens = np.memmap(path, dtype=np.uint16, mode="r")
  # Every id, once (an id >= vocab_size would give NaN logits, not an error, during training).
  top = max(int(tokens[i:i + 2**24].max()) for i in range(0, len(tokens), 2**24))
  if top >= vocab_size:
    raise ValueError(f"token file {str(path)!r} holds token id {top} >= vocab_size {vocab_size}")
  train, valid = _split(tokens, valid_fraction, context, f"token file {str(path)!r}")
  return Dataset(train, valid, vocab_size, str(path), _sha256(path))


def load(path, context: int, vocab_size: int | None = None, valid_fraction: float = 0.1) -> Dataset:
  """``None``: the default corpus; ``"stdlib-all"``: every standard-library file (when no such file
  exists here); ``*.bin``: uint16 tokens (needs vocab_size, default 50257 for GPT-2 tokens);
  anything else: a byte-level text file."""
  if str(path).endswith(".bin"):
    return token_file(path, context, 50257 if vocab_size is None else vocab_size, valid_fraction)
  if vocab_size is not None:
    raise ValueError(f"--vocab-size {vocab_size} applies to .bin token files only; "
                     f"{'the default corpus' if path is None else repr(str(path))} is read as bytes "
                     "(vocabulary 256)")
  if path is None:
    return default_corpus(context, valid_fraction)
  if str(path) == WHOLE_STDLIB and not pathlib.Path(path).exists():
    return default_corpus(context, valid_fraction, max_bytes=None)
  return text_file(path, context, valid_fraction)


def check_bpe_vocab(vocab_size: int) -> None:
  """A byte-level BPE vocabulary holds the 256 bytes and at least one merge, in 16-bit token ids."""
  if not 256 < vocab_size <= 2**16:
    raise ValueError(f"BPE vocabulary must be in (256, 65536], got {vocab_size}")


def bpe_token_file(raw: bytes, vocab_size: int, out_dir, valid_fraction: float = 0.1) -> pathlib.Path:
  """Trains a byte-level BPE tokenizer offline on ``raw``'s training split and writes the whole text
  as a uint16 token file beside it (``bpe<V>.json``, ``bpe<V>.bin``); an existing pair is reused.

  The tokenizer never sees the last ``valid_fraction`` of the text (the validation split of the
  token file is, to within a token, the same text). Uses the ``tokenizers`` library.
  """
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  check_bpe_vocab(vocab_size)
  out_dir = pathlib.Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  json_path, bin_path = out_dir / f"bpe{vocab_size}.json", out_dir / f"bpe{vocab_size}.bin"
  if json_path.exists() and bin_path.exists():
    return bin_path
  text = raw.decode("utf-8", errors="replace")
  train_text = text[:int(len(text) * (1 - valid_fraction))]
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  lines = train_text.splitlines(keepends=True)
  tok.train_from_iterator((lines[i:i + 1000] for i in range(0, len(lines), 1000)), trainer)
  pieces = text.splitlines(keepends=True)
  ids = [i for enc in tok.encode_batch(["".join(pieces[j:j + 200]) for j in range(0, len(pieces), 200)])
         for i in enc.ids]
  tmp = bin_path.with_suffix(".tmp")
  np.asarray(ids, np.uint16).tofile(tmp)
  tok.save(str(json_path))
  tmp.replace(bin_path)
  return bin_path
