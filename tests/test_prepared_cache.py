"""The prepared-weight cache (verifier/prepare/cache.py): a float checkpoint's W8A8 preparation is
saved on its first load and read back on the next, bit-identical; a changed setting, checkpoint
or entry misses or is rebuilt; replicas starting together prepare once; and a load gives the
same bits on 1 and 2 threads, so replicas on hosts without a shared cache serve one model.
(A tiny Qwen2.5-shaped checkpoint: the bundled model's preparation takes seconds a time.)"""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

import pardec.verifier
from pardec.verifier import loading
from pardec.verifier.loading import load_model
from pardec.verifier.model.kv_contiguous import KVCache
from pardec.verifier.model.weights import load_checkpoint
from pardec.verifier.prepare.cache import PreparedCache, checkpoint_fingerprint, code_fingerprint, default_directory
from tests.tiny_checkpoints import transformers_model, write_hf


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = write_hf(transformers_model("qwen2.5"), tmp_path_factory.mktemp("tiny"), load_checkpoint(None).tokenizer)
    return load_checkpoint(str(directory))


@pytest.fixture
def preparations(monkeypatch):
    """Counts the preparations that really ran."""
    calls = []
    real = loading.preconditioned

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(loading, "preconditioned", counted)
    return calls


def logits(model, checkpoint) -> torch.Tensor:
    tokens = checkpoint.tokenizer.encode_chat("Say something only this model would say.")
    count = len(tokens)
    cache = KVCache(checkpoint.args, count)
    return model(torch.tensor(tokens), torch.arange(count), torch.ones(count, count, dtype=torch.bool).tril(), cache)


def test_a_second_load_reads_the_cache_bit_identical(checkpoint, tmp_path, preparations):
    cache = PreparedCache(tmp_path)
    first = load_model(checkpoint, prepared_cache=cache)
    entries = list(tmp_path.glob("*.safetensors"))
    assert len(preparations) == 1 and len(entries) == 1
    start = time.perf_counter()
    second = load_model(checkpoint, prepared_cache=cache)
    assert len(preparations) == 1, "the second load prepared again"
    print(f"load from the cache: {time.perf_counter() - start:.2f} s")
    reference = logits(first, checkpoint)
    assert torch.equal(logits(second, checkpoint), reference)
    # A changed setting is another entry.
    load_model(checkpoint, prepared_cache=cache, gptq=False)
    assert len(preparations) == 2 and len(list(tmp_path.glob("*.safetensors"))) == 2

    # A corrupt entry (a flipped byte in its data) is caught by its checksum and prepared again.
    entry = entries[0]
    data = bytearray(entry.read_bytes())
    data[-100] ^= 0xFF
    entry.write_bytes(bytes(data))
    rebuilt = load_model(checkpoint, prepared_cache=cache)
    assert len(preparations) == 3 and torch.equal(logits(rebuilt, checkpoint), reference)
    # A partial entry (cut short) too.
    entry.write_bytes(entry.read_bytes()[: 1000])
    load_model(checkpoint, prepared_cache=cache)
    assert len(preparations) == 4
    load_model(checkpoint, prepared_cache=cache)
    assert len(preparations) == 4


def test_the_key_follows_the_checkpoint_and_the_settings(tmp_path):
    model = tmp_path / "model.gguf"
    model.write_bytes(os.urandom(3 << 20))
    before = checkpoint_fingerprint(str(model))
    assert checkpoint_fingerprint(str(model)) == before
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 1  # a sampled byte... or only its modification time below
    model.write_bytes(bytes(data))
    os.utime(model, ns=(1, 1))
    changed = checkpoint_fingerprint(str(model))
    assert changed != before
    assert PreparedCache.key(changed, {"gptq": True}) != PreparedCache.key(changed, {"gptq": False})
    assert PreparedCache.key(changed, {"gptq": True}) != PreparedCache.key(before, {"gptq": True})


def test_the_key_follows_the_preparing_code(tmp_path):
    """A change to any Python or C source of the code that prepares misses every older entry."""
    package = tmp_path / "verifier"
    shutil.copytree(Path(pardec.verifier.__file__).parent, package, ignore=shutil.ignore_patterns("__pycache__"))
    before = code_fingerprint(package=package)
    (package / "prepare" / "notes.txt").write_text("not code")
    assert code_fingerprint(package=package) == before
    for source in (package / "prepare" / "gptq.py", package / "kernels" / "int8_linear.c"):
        source.write_text(source.read_text() + "\n")
        assert code_fingerprint(package=package) != before
        before = code_fingerprint(package=package)


def test_replicas_starting_together_prepare_once(tmp_path):
    cache = PreparedCache(tmp_path)
    calls = []

    def prepare():
        calls.append(1)
        time.sleep(0.5)
        return {"w": torch.arange(12, dtype=torch.int8).view(3, 4), "marker": torch.tensor(64)}

    results = []
    threads = [threading.Thread(target=lambda: results.append(cache.prepared("k", prepare))) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and len(results) == 3
    assert all(torch.equal(r["w"], results[0]["w"]) and int(r["marker"]) == 64 for r in results)
    assert not list(tmp_path.glob("*.tmp"))


def test_the_default_directory_is_the_users_cache():
    assert default_directory({"XDG_CACHE_HOME": "/x"}) == default_directory({"XDG_CACHE_HOME": "/x", "HOME": "/h"})
    assert str(default_directory({"XDG_CACHE_HOME": "/x"})) == "/x/pardec"
    assert str(default_directory({})).endswith(os.path.join(".cache", "pardec"))


def test_a_load_gives_the_same_bits_on_one_and_two_threads(checkpoint):
    threads = torch.get_num_threads()
    models = {}
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            models[count] = load_model(checkpoint)
    finally:
        torch.set_num_threads(threads)
    one, two = (dict(models[count].state_dict()) for count in (1, 2))
    assert one.keys() == two.keys()
    differing = [name for name in one if not torch.equal(one[name], two[name])]
    assert not differing, differing[:10]


def test_an_unusable_cache_directory_or_disk_costs_a_preparation_only(tmp_path, monkeypatch):
    tensors = {"w": torch.arange(6, dtype=torch.int8).reshape(2, 3)}
    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("")
    assert PreparedCache(not_a_directory / "cache").prepared("k", lambda: tensors) is tensors

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("safetensors.torch.save_file", full_disk)
    cache = PreparedCache(tmp_path / "cache")
    assert cache.prepared("k", lambda: tensors) is tensors
    assert not list((tmp_path / "cache").glob("*.safetensors")) and not list((tmp_path / "cache").glob("*.tmp"))


def test_a_damaged_entry_is_prepared_again_and_a_replaced_one_is_kept(tmp_path):
    from pardec.verifier.prepare.cache import CorruptEntry

    tensors = {"w": torch.arange(6, dtype=torch.int8).reshape(2, 3), "s": torch.ones(2)}
    cache = PreparedCache(tmp_path)
    cache.prepared("k", lambda: tensors)
    entry = cache.path("k")
    # A header whose offsets do not fit the tensor's shape: refused when opened, prepared again.
    data = entry.read_bytes()
    entry.write_bytes(data.replace(b'"shape":[2,3]', b'"shape":[3,3]'))
    prepared = []
    assert cache.prepared("k", lambda: prepared.append(1) or tensors) is tensors and prepared == [1]
    # A flipped data byte: found as the tensor is read.
    data = bytearray(entry.read_bytes())
    data[-1] ^= 0xFF
    entry.write_bytes(bytes(data))
    lazy = cache.prepared("k", lambda: tensors)
    with pytest.raises(CorruptEntry) as damaged:
        [lazy[name] for name in lazy]
    # Another replica has meanwhile replaced it with a good entry: discarding the damaged one leaves it.
    replacement = tmp_path / "good"
    replacement.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    replacement.replace(entry)
    cache.discard("k", damaged.value)
    assert entry.exists() and torch.equal(cache.prepared("k", lambda: {})["w"], tensors["w"])
    # The damaged file itself is removed.
    cache.discard("k", CorruptEntry("", (entry.stat().st_dev, entry.stat().st_ino)))
    assert not entry.exists()
