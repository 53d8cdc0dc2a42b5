"""Test data shared by several test modules (imported as ``tests.helpers``; the fixtures live
in conftest.py)."""

# A one-kernel PTX module: add_one(float* p) adds 1.0 to p[0]. Written for sm_90; tests that
# link it for another architecture replace the target.
TINY_PTX = """
.version 8.0
.target sm_90
.address_size 64

.visible .entry add_one(
    .param .u64 p
)
{
    .reg .b64 %rd<3>;
    .reg .f32 %f<3>;
    ld.param.u64 %rd1, [p];
    cvta.to.global.u64 %rd2, %rd1;
    ld.global.f32 %f1, [%rd2];
    add.f32 %f2, %f1, 0f3F800000;
    st.global.f32 [%rd2], %f2;
    ret;
}
"""


def in_threads(fn, n: int) -> None:
    """Run ``fn(k)`` for k in range(n), each in its own thread, and raise the first exception
    any of them raised (after all have ended)."""
    import threading

    errors: list = []

    def run(k):
        try:
            fn(k)
        except BaseException as exc:  # noqa: BLE001 - re-raised below, in the test's thread
            errors.append(exc)

    ts = [threading.Thread(target=run, args=(k,)) for k in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise errors[0]
