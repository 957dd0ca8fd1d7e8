"""Issue 36.3: the OS refusing a file -- a read-only output folder, a full disk during PTQ and
during export, a permission denied -- is one `error:` line naming the path and the OS cause
(exit 2, no traceback), and where it can be known before any work, the plan says it first:
a write probe of the output folder and its free space against an estimate of what the job
writes (amct_ext/io/output_space.py; casebook/no-traceback.md i36t-1..3).

A full disk is simulated by a file object whose writes raise OSError(ENOSPC) after a few bytes;
a read-only folder by chmod where that binds, and as root (where chmod does not bind) by an
os.open that raises EACCES for paths under the folder -- the call tempfile.mkstemp makes.
"""
import builtins
import errno
import os
import sys
from collections import namedtuple
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

import export as export_tool  # noqa: E402
import run_ptq  # noqa: E402

from amct_ext.errors import OutputError  # noqa: E402
from amct_ext.io import io_utils, output_space  # noqa: E402

FAST = ["--calib-samples", "2", "--seq-len", "32", "--eval-windows", "2", "--quiet"]


class _FullDisk:
    """A binary file whose writes fail with ENOSPC once ``room`` bytes went out (as a full disk)."""

    def __init__(self, f, room: int):
        self.f, self.room = f, room

    def write(self, b):
        n = len(b) if isinstance(b, str) else memoryview(b).nbytes
        if n > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= n
        return self.f.write(b)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def full_disk_open(room: int = 64):
    real = builtins.open

    def fake(path, mode="r", *a, **k):
        f = real(path, mode, *a, **k)
        return _FullDisk(f, room) if "w" in mode or "a" in mode else f
    return fake


def read_only(request, monkeypatch, folder: Path) -> None:
    """Make ``folder`` refuse new files: chmod where that binds, else (root) os.open raising EACCES."""
    folder.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        folder.chmod(0o555)
        request.addfinalizer(lambda: folder.chmod(0o755))
        return
    real = os.open
    prefix = str(folder.absolute())

    def fake(path, flags, *a, **k):
        if str(Path(path).absolute()).startswith(prefix) and flags & (os.O_CREAT | os.O_WRONLY | os.O_RDWR):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real(path, flags, *a, **k)
    monkeypatch.setattr(os, "open", fake)


def one_error_line(capsys, code: int) -> str:
    cap = capsys.readouterr()
    err = cap.err.strip().splitlines()
    assert code == 2, (code, cap.err[-800:])
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert "Traceback" not in cap.err
    return err[0]


# ----------------------------------------------------------------------------- atomic writers
def test_atomic_save_full_disk_is_one_line_and_leaves_nothing_torn(tmp_path, monkeypatch):
    """torch.save through a file object: ENOSPC arrives as OSError, named with the final path;
    no temporary file is left and the previous file under the final name is untouched."""
    target = tmp_path / "unit.pt"
    io_utils.atomic_save({"a": torch.ones(3)}, target)
    before = target.read_bytes()
    monkeypatch.setattr(io_utils, "open", full_disk_open(), raising=False)
    with pytest.raises(OutputError) as e:
        io_utils.atomic_save({"a": torch.zeros(100_000)}, target)
    line = str(e.value)
    assert str(target) in line and "No space left on device [ENOSPC]" in line and "\n" not in line
    assert target.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["unit.pt"]


def test_atomic_write_in_a_read_only_folder_names_it(request, tmp_path, monkeypatch):
    folder = tmp_path / "ro"
    read_only(request, monkeypatch, folder)
    with pytest.raises(OutputError, match=r"cannot write .*ro/report.json: Permission denied \[EACCES\]"):
        io_utils.atomic_write_json({"x": 1}, folder / "report.json")
    assert list(folder.iterdir()) == []


# ----------------------------------------------------------------------------- the tools' boundary
def test_run_ptq_turns_an_os_error_into_one_line(monkeypatch, capsys):
    def raise_eacces(args, phases=None):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), "/data/out/ptq_params")
    monkeypatch.setattr(run_ptq, "run", raise_eacces)
    line = one_error_line(capsys, run_ptq.main(["--output-dir", "/data/out"]))
    assert line == "error: /data/out/ptq_params: Permission denied [EACCES]"


def test_export_turns_an_os_error_into_one_line(monkeypatch, capsys):
    def raise_erofs(args, model_path=None, allow_distributed=True):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), "/data/e/config.json")
    monkeypatch.setattr(export_tool, "export_from_args", raise_erofs)
    line = one_error_line(capsys, export_tool.main(["--format", "compressed-tensors", "--out", "/data/e"]))
    assert line == "error: /data/e/config.json: Read-only file system [EROFS]"


def test_a_bug_still_shows_its_traceback(monkeypatch):
    """Only user-fixable errors become one line: a bug of the tool keeps its traceback."""
    def bug(args, phases=None):
        raise KeyError("internal")
    monkeypatch.setattr(run_ptq, "run", bug)
    with pytest.raises(KeyError):
        run_ptq.main(["--output-dir", "/data/out"])


# ----------------------------------------------------------------------------- the plan, before any work
def test_read_only_output_folder_refused_before_any_work(request, tiny_ckpt, tmp_path, monkeypatch, capsys):
    out = tmp_path / "ro"
    read_only(request, monkeypatch, out)
    code = run_ptq.main(["--model", "tiny", "--model-path", str(tiny_ckpt), "--output-dir", str(out), *FAST])
    line = one_error_line(capsys, code)
    assert line.startswith(f"error: --output-dir {out}: cannot write into it") and "[EACCES]" in line
    assert not (out / "ptq_params").exists()


def test_output_folder_not_yet_there_is_probed_where_it_will_be_created(request, tiny_ckpt, tmp_path, monkeypatch, capsys):
    parent = tmp_path / "ro"
    read_only(request, monkeypatch, parent)
    code = run_ptq.main(["--model", "tiny", "--model-path", str(tiny_ckpt), "--output-dir", str(parent / "a" / "b"),
                         *FAST])
    line = one_error_line(capsys, code)
    assert f"(it would be created in {parent})" in line


def _small_disk(monkeypatch, free: int):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(output_space.shutil, "disk_usage", lambda p: usage(10 * free, 9 * free, free))


def test_too_little_free_space_refused_before_any_work(tiny_ckpt, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    _small_disk(monkeypatch, 300 << 10)    # 0.3 MiB: less than the 1 MiB allowance for the small files
    code = run_ptq.main(["--model", "tiny", "--model-path", str(tiny_ckpt), "--output-dir", str(out), *FAST])
    line = one_error_line(capsys, code)
    assert f"--output-dir {out}: 0.3 MiB free on its disk, but the run will write about" in line
    assert "ppl[" not in capsys.readouterr().out and not out.exists()


def test_free_space_counts_the_export(tiny_ckpt, tmp_path, monkeypatch):
    """A disk that holds exactly the export's estimate alone (the checkpoint's bytes + the
    small-files allowance) holds the run (1 MiB + 40 units x 8 KiB) but not the run with its export."""
    from amct_ext.data import CALIB_DEFAULT
    from amct_ext.pipeline.job import PtqOptions, ResolvedPaths, build_job
    from models.deepseek_v4.plan import DeepseekV4PlanSpec

    ck = output_space.checkpoint_bytes(tiny_ckpt)
    assert ck == sum(p.stat().st_size for p in tiny_ckpt.iterdir() if p.name.endswith(".safetensors"))
    assert ck > 512 << 10    # so ck + 1 MiB > the run's 1.3 MiB: the export decides
    _small_disk(monkeypatch, ck + output_space.SMALL_FILES_BYTES)

    def req(**kw):
        return PtqOptions(output_dir=str(tmp_path / "o"), calib_samples=2, seq_len=32, batch_size=1,
                          eval_batch_size=1, dtype="bf16", **kw)
    paths = ResolvedPaths(tiny_ckpt, CALIB_DEFAULT)
    build_job(req(), DeepseekV4PlanSpec(), paths)
    with pytest.raises(OutputError, match="the run and its compressed-tensors export will write about"):
        build_job(req(export="compressed-tensors"), DeepseekV4PlanSpec(), paths)


def test_ptq_estimate_by_what_the_recipe_stores():
    """codes at one byte (half packed at <= 4 bits) for weight-replacing algorithms, the float
    weight for smoothing, only the allowances for clip-only recipes."""
    numel = {4: 1000, 8: 100}
    small = output_space.SMALL_FILES_BYTES
    assert output_space.ptq_params_bytes(numel, ["hclip"], 2) == small
    assert output_space.ptq_params_bytes(numel, ["hclip", "gptq"], 2) == 500 + 100 + small
    assert output_space.ptq_params_bytes(numel, ["awq", "gptq"], 2, n_units=3) == 1100 * 2 + 3 * (8 << 10) + small
    assert output_space.export_bytes(1000, dequantize_rest=True) == 2000 + small


def test_quantized_weight_count_of_the_plan(tiny_ckpt):
    """The estimate's weight count equals the quantized leaves of a real quantized block."""
    from amct_ext.quant.quant_linear import QuantLinear
    from amct_ext.quant.schemes import load_scheme
    from models.deepseek_v4 import quant_module
    from models.deepseek_v4.loading import empty_block, load_config
    from models.deepseek_v4.plan import DeepseekV4PlanSpec

    config = load_config(tiny_ckpt)
    scheme = load_scheme("w4a16")
    targets = ["attn-linear", "moe"]
    expect = 0
    for i in range(config.n_layers):   # every layer built, not one per kind
        block = empty_block(config, i, torch.bfloat16)
        quant_module.quantize_block(block, scheme, targets)
        expect += sum(m.weight.numel() for m in block.modules()
                      if isinstance(m, QuantLinear) and m.weight_quantizer.spec is not None)
    got = DeepseekV4PlanSpec().quantized_weight_numel(config, scheme, targets, range(config.n_layers))
    assert got == {4: expect} and expect > 0


# ----------------------------------------------------------------------------- during the work
def test_full_disk_during_ptq_is_one_line_naming_the_file(tiny_ckpt, tmp_path, monkeypatch, capsys):
    """The plan passes (the disk looks large), then every write runs out of space."""
    out = tmp_path / "out"
    monkeypatch.setattr(io_utils, "open", full_disk_open(), raising=False)
    code = run_ptq.main(["--model", "tiny", "--model-path", str(tiny_ckpt), "--output-dir", str(out), *FAST,
                         "--no-eval-ppl"])
    line = one_error_line(capsys, code)
    assert line.startswith(f"error: cannot write {out / 'ptq_params'}") and line.endswith(
        "No space left on device [ENOSPC]")
    assert not list(out.rglob("*.pt")) and not list(out.rglob("*.tmp"))   # nothing torn, no temporary file


def test_full_disk_during_export_is_one_line_naming_the_shard(tiny_ckpt, tmp_path, monkeypatch, capsys):
    from amct_ext.export import writer

    out = tmp_path / "e"
    monkeypatch.setattr(writer, "open", full_disk_open(4096), raising=False)
    code = export_tool.main(["--model", "tiny", "--model-path", str(tiny_ckpt), "--scheme", "w8a8",
                             "--format", "compressed-tensors", "--out", str(out), "--quiet", "--device", "cpu"])
    line = one_error_line(capsys, code)
    assert line.startswith(f"error: cannot write {out}/") and line.endswith("No space left on device [ENOSPC]")
    assert not list(out.glob("*.safetensors")) and not (out / "model.safetensors.index.json").exists()


def test_read_only_export_folder_refused_before_any_layer(request, tiny_ckpt, tmp_path, monkeypatch, capsys):
    out = tmp_path / "e"
    read_only(request, monkeypatch, out)
    code = export_tool.main(["--model", "tiny", "--model-path", str(tiny_ckpt), "--scheme", "w8a8",
                             "--format", "compressed-tensors", "--out", str(out), "--quiet", "--device", "cpu"])
    line = one_error_line(capsys, code)
    assert line.startswith(f"error: --out {out}: cannot write into it") and "[EACCES]" in line


def test_export_too_little_free_space_refused(tiny_ckpt, tmp_path, monkeypatch, capsys):
    """ascend stores the rest in bf16: twice the checkpoint's bytes; a disk with room for one
    copy is refused."""
    _small_disk(monkeypatch, output_space.checkpoint_bytes(tiny_ckpt) + output_space.SMALL_FILES_BYTES)
    out = tmp_path / "e"
    code = export_tool.main(["--model", "tiny", "--model-path", str(tiny_ckpt), "--scheme", "w8a8",
                             "--format", "ascend", "--out", str(out), "--quiet", "--device", "cpu"])
    line = one_error_line(capsys, code)
    assert f"--out {out}:" in line and "the ascend export will write about" in line
    assert not out.exists()
