"""User-facing errors: each carries one line that names the file, key, field or shape at fault."""


class AmctError(Exception):
    """Base class of every error the tool raises on bad input (not on its own bugs)."""


class ConfigError(AmctError, ValueError):
    """A config field is missing or impossible."""


class CheckpointError(AmctError):
    """A checkpoint file, index entry or tensor is missing, unsafe or malformed."""


class QuantConfigError(AmctError, ValueError):
    """A scheme, format or quant target is unknown or inconsistent."""


class DataError(AmctError):
    """Evaluation / calibration data cannot be found or is unusable."""


class DeviceMemoryError(AmctError):
    """A stage needs more device memory than the device has (named with its sizes)."""


class OutputError(AmctError):
    """An output file or folder cannot be written: read-only, full disk, no permission, too
    little free space for what the run will write."""


class ModelContractError(AmctError, TypeError):
    """A model port declares a capability (e.g. MTP layers) without the hook that serves it: named
    with the model class and the hook, raised when the hook is reached."""


def os_error_line(e: OSError, path: object = None) -> str:
    """One line for an OS error: the path (``path``, else the error's own file name) and the
    OS cause with its errno name, e.g. ``/out/ptq_params: Permission denied [EACCES]``."""
    import errno as _errno

    where = path if path is not None else e.filename
    cause = e.strerror or str(e) or type(e).__name__
    code = _errno.errorcode.get(e.errno, "") if e.errno is not None else ""
    text = f"{cause} [{code}]" if code else cause
    if where is not None and e.filename2 is not None and path is None:
        return f"{where} -> {e.filename2}: {text}"
    return f"{where}: {text}" if where is not None else text


def user_error_line(e: BaseException) -> str | None:
    """The one ``error:`` line a command-line tool prints for an error the user can fix (bad
    input, or the OS refusing a file: read-only folder, full disk, permission), or None for
    anything else (a bug of the tool: its traceback is wanted)."""
    if isinstance(e, AmctError):
        return str(e).splitlines()[0] if str(e) else type(e).__name__
    if isinstance(e, OSError) and e.errno is not None:
        return os_error_line(e)
    return None
