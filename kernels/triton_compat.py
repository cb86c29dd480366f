"""`triton` and `triton.language` for the kernel modules. triton is a Linux-only dependency: where it is
missing, the torch references stay importable and any Triton kernel raises when used."""
try:
    import triton
    import triton.language as tl
except ImportError:
    class _NoTriton:
        constexpr = staticmethod(lambda value=None: value)

        @staticmethod
        def jit(fn=None, **kwargs):
            return fn if fn is not None else (lambda f: f)

        def __getattr__(self, name):
            raise RuntimeError("triton is not installed")

    triton = tl = _NoTriton()

__all__ = ["triton", "tl"]
