import numpy as np
import pytest

from experiments.harness import data


@pytest.fixture(scope="module")
def corpus():
  return data.default_corpus(context=16)


def test_default_corpus_identity(corpus):
  assert corpus.vocab_size == 256
  assert corpus.num_tokens == data.DEFAULT_CORPUS_BYTES
  assert len(corpus.sha256) == 64
  assert data.default_corpus(context=16).sha256 == corpus.sha256
  files = data.stdlib_files()
  assert files == sorted(files) and all(p.suffix == ".py" for p in files)
  assert bytes(corpus.train[:64]) == files[0].read_bytes()[:64]


def test_batches_are_pure_functions_of_seed_and_step(corpus):
  a = corpus.batch(seed=1, step=7, batch_size=4, context=16)
  b = corpus.batch(seed=1, step=7, batch_size=4, context=16)
  c = corpus.batch(seed=1, step=8, batch_size=4, context=16)
  np.testing.assert_array_equal(a[0], b[0])
  assert not np.array_equal(a[0], c[0])
  assert a[0].shape == (4, 16) and a[0].dtype == np.int32
  np.testing.assert_array_equal(a[0][:, 1:], a[1][:, :-1])
  stacked = corpus.batches(seed=1, first_step=5, num_steps=4, batch_size=4, context=16)
  np.testing.assert_array_equal(stacked[0][2], a[0])  # step 5 + 2 == 7: resuming sees the same batch
  v = corpus.batch(seed=1, step=7, batch_size=4, context=16, split="valid")
  assert not np.array_equal(v[0], a[0])


def test_train_valid_split(corpus):
  assert len(corpus.valid) == int(corpus.num_tokens * 0.1)
  raw = np.concatenate([corpus.train, corpus.valid])
  np.testing.assert_array_equal(raw[len(corpus.train):][:10], corpus.valid[:10])
  assert len(corpus.train) + len(corpus.valid) == len(raw)


def test_text_and_token_files(tmp_path):
  text = tmp_path / "t.txt"
  text.write_bytes(bytes(range(256)) * 4)
  ds = data.load(text, context=8)
  assert ds.vocab_size == 256 and ds.num_tokens == 1024
  tokens = (np.arange(5000) % 1000).astype(np.uint16)
  path = tmp_path / "tok.bin"
  tokens.tofile(path)
  ds = data.load(path, context=8, vocab_size=1000)
  assert ds.vocab_size == 1000
  np.testing.assert_array_equal(ds.train[:20], tokens[:20])
  x, y = ds.batch(0, 0, 2, 8)
  np.testing.assert_array_equal((x + 1) % 1000, y)


def test_bad_files(tmp_path):
  with pytest.raises(FileNotFoundError, match="nope.txt"):
    data.load(tmp_path / "nope.txt", context=8)
  empty = tmp_path / "empty.txt"
  empty.write_bytes(b"")
  with pytest.raises(ValueError, match="is empty"):
    data.load(empty, context=8)
  short = tmp_path / "short.txt"
  short.write_bytes(b"x" * 30)
  with pytest.raises(ValueError, match=r"short.txt.*has 30 tokens.*need at least 20 tokens"):
    data.load(short, context=8)
  big = tmp_path / "big.bin"
  np.full(100, 700, np.uint16).tofile(big)
  with pytest.raises(ValueError, match="token id 700 >= vocab_size 500"):
    data.load(big, context=8, vocab_size=500)


def test_bpe_token_file_is_offline_deterministic_and_reused(tmp_path):
  text = ("def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n" * 400).encode()
  path = data.bpe_token_file(text, 300, tmp_path / "a")
  again = data.bpe_token_file(text, 300, tmp_path / "b")
  ids = np.fromfile(path, np.uint16)
  np.testing.assert_array_equal(ids, np.fromfile(again, np.uint16))
  assert 0 < len(ids) < len(text) and ids.max() < 300  # subwords: fewer tokens than bytes
  from tokenizers import Tokenizer
  tok = Tokenizer.from_file(str(path.with_suffix(".json")))
  assert tok.decode(ids.tolist()) == text.decode()
  mtime = path.stat().st_mtime_ns
  assert data.bpe_token_file(text, 300, tmp_path / "a") == path and path.stat().st_mtime_ns == mtime


def test_unreadable_and_late_out_of_vocabulary_files(tmp_path, monkeypatch):
  late = tmp_path / "late.bin"  # the bad id sits past the first 2^22 tokens (checked before: none)
  ids = np.zeros(2**22 + 100, np.uint16)
  ids[-1] = 600
  ids.tofile(late)
  with pytest.raises(ValueError, match="token id 600 >= vocab_size 500"):
    data.load(late, context=8, vocab_size=500)
  text = tmp_path / "locked.txt"
  text.write_bytes(b"x" * 1000)

  def refuse(*args, **kwargs):
    raise PermissionError(13, "Permission denied")

  monkeypatch.setattr(data, "open", refuse, raising=False)  # (root reads any file: no chmod test)
  with pytest.raises(ValueError, match="locked.txt' cannot be read: Permission denied"):
    data.load(text, context=8)


def _small(n=2_000):
  rng = np.random.default_rng(3)
  tokens = rng.integers(0, 256, size=n).astype(np.uint8)
  return data.Dataset(tokens[:1800], tokens[1800:], 256, "small", "sha")


def test_single_pass_predicts_every_training_token_at_most_once():
  ds = _small()
  context, batch = 16, 4
  windows = ds.windows(context)
  assert windows == (1800 - 1) // 16  # disjoint windows of 16 targets, each one token's lookahead
  steps = windows // batch
  seen = []
  for step in range(steps):
    x, y = ds.batch(5, step, batch, context, sampling="single-pass")
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
    for row_x, row_y in zip(x, y):  # each row is the split at a multiple of the context
      start = int(np.flatnonzero([np.array_equal(ds.train[s:s + context], row_x)
                                  for s in range(0, 1800 - context, context)])[0]) * context
      np.testing.assert_array_equal(ds.train[start + 1:start + context + 1], row_y)
      seen.append(start)
  assert len(seen) == len(set(seen)) == steps * batch  # no window twice within one pass
  again = ds.batches(5, 3, 2, batch, context, "single-pass")  # pure: a resumed run sees the same
  np.testing.assert_array_equal(again[0][0], ds.batch(5, 3, batch, context, sampling="single-pass")[0])
  other = ds.batch(6, 0, batch, context, sampling="single-pass")[0]
  assert not np.array_equal(other, ds.batch(5, 0, batch, context, sampling="single-pass")[0])
  with pytest.raises(ValueError, match="would repeat tokens"):
    ds.batch(5, steps + 1, batch, context, sampling="single-pass")
  ds.check_single_pass(steps, batch, context)
  held = f"need {(steps + 1) * batch} windows, but small's training split holds {windows}"
  with pytest.raises(ValueError, match=held):
    ds.check_single_pass(steps + 1, batch, context)
  valid = ds.batch(5, 0, batch, context, split="valid", sampling="single-pass")  # validation: random
  np.testing.assert_array_equal(valid[0], ds.batch(5, 0, batch, context, split="valid")[0])
  with pytest.raises(ValueError, match="unknown sampling 'twice'"):
    ds.batch(5, 0, batch, context, sampling="twice")


def test_the_whole_standard_library_is_a_named_corpus_of_its_own():
  whole = data.load(data.WHOLE_STDLIB, context=32)
  files = data.stdlib_files()
  assert whole.num_tokens == sum(p.stat().st_size for p in files) > data.DEFAULT_CORPUS_BYTES
  assert whole.name.endswith("-stdlib-all") and whole.sha256 != data.load(None, context=32).sha256
  assert bytes(whole.valid[-64:]) == files[-1].read_bytes()[-64:]
