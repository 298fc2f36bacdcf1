"""Errors users see. Every message names the problem and the fix.

One class per kind of mistake so tests and callers can catch precisely; all derive from FusionError.
"""


class FusionError(Exception):
    """Base of every error fusion raises on purpose."""


class OpArgumentError(FusionError, ValueError, TypeError):
    """An op, a Sequential or one of their methods was given an argument it cannot take (wrong type, not a
    finite number, not a positive size, an unknown name); the message names the op, the argument and the fix.

    Both a ValueError and a TypeError: Python raises either for a bad argument, and code that caught the one
    these checks used to raise still catches them.
    """


class ShapeError(FusionError, ValueError):
    """A tensor or op has a shape the next op cannot take."""


class DTypeError(FusionError, TypeError):
    """A dtype is not supported here, or tensors of one call mix dtypes."""


class DeviceError(FusionError, ValueError):
    """Tensors of one call live on different devices."""


class ExtraInputError(FusionError, TypeError):
    """A keyword input of Sequential.__call__ is missing, unexpected, or malformed."""


class GroupSizesError(ExtraInputError, ValueError):
    """group_sizes has the wrong length, dtype, device or sum."""


class FallbackError(FusionError, RuntimeError):
    """backend="fused" was asked for but some op would run unfused; the message lists why."""


class SecondBackwardError(FusionError, RuntimeError):
    """A second backward through an eager fused block (retain_graph=True): the first backward freed the values its
    forward saved, each after its last reader, to lower the step's peak memory."""


class PatternError(FusionError, ValueError):
    """A .fpat file has a mistake; the message has file, line, column, the text and what was expected."""


class CompileError(FusionError, RuntimeError):
    """A kernel failed to compile; the message names the kernel and the plan step."""


class KernelConfigError(FusionError, ValueError):
    """A kernel configuration (tile shape, operand layout, epilogue, shapes) the kernel template cannot build;
    the message names the constraint and what to change."""


class TargetError(FusionError, ValueError):
    """A GPU target string fusion cannot read (fusion.targets.parse_target); the message shows the accepted
    forms ("sm_90a", "sm_90", "sm_100a"...)."""


class CacheDirError(CompileError):
    """The kernel cache folder cannot be created or written; the message names the folder and says to point
    FUSION_CACHE_DIR at a writable one."""
