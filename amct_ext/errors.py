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
