"""Mooncake transfer of GPU memory over TCP on loopback between two engines.

Two TransferEngine instances in this process (metadata "P2PHANDSHAKE": no etcd), protocol tcp,
each registering a CUDA buffer. The initiator writes its buffer into the target's, then reads a
second region back, and both directions are compared byte for byte on the GPU.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).absolute().parent))
from conftest import import_or_fail  # noqa: E402

torch = import_or_fail("torch")

SIZE = 4 << 20  # 4 MiB each way: the size docs/measurements/ records passing on an H200


def _engine():
    from mooncake.engine import TransferEngine  # missing Mooncake: an error, not a skip

    te = TransferEngine()
    rc = te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    assert rc == 0, f"TransferEngine.initialize returned {rc}"
    return te


@pytest.mark.arch("sm90", "sm100", "sm120")
def test_gpu_memory_roundtrip_over_tcp_loopback() -> None:
    target, initiator = _engine(), _engine()
    dev = torch.device("cuda", 0)
    gen = torch.Generator(device=dev).manual_seed(1234)
    src = torch.randint(0, 256, (SIZE,), dtype=torch.uint8, device=dev, generator=gen)
    dst = torch.zeros(2 * SIZE, dtype=torch.uint8, device=dev)  # [written | to be read back]
    dst[SIZE:] = torch.randint(0, 256, (SIZE,), dtype=torch.uint8, device=dev, generator=gen)
    back = torch.zeros(SIZE, dtype=torch.uint8, device=dev)
    torch.cuda.synchronize()

    assert target.register_memory(dst.data_ptr(), dst.numel()) == 0
    assert initiator.register_memory(src.data_ptr(), src.numel()) == 0
    assert initiator.register_memory(back.data_ptr(), back.numel()) == 0
    session = f"127.0.0.1:{target.get_rpc_port()}"

    rc = initiator.transfer_sync_write(session, src.data_ptr(), dst.data_ptr(), SIZE)
    assert rc == 0, f"transfer_sync_write returned {rc}"
    rc = initiator.transfer_sync_read(session, back.data_ptr(), dst.data_ptr() + SIZE, SIZE)
    assert rc == 0, f"transfer_sync_read returned {rc}"
    torch.cuda.synchronize()

    assert torch.equal(dst[:SIZE], src), "GPU->GPU write over TCP corrupted the data"
    assert torch.equal(back, dst[SIZE:]), "GPU<-GPU read over TCP corrupted the data"
    print(f"mooncake tcp loopback: {SIZE} B written and {SIZE} B read back on {torch.cuda.get_device_name(0)}")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-s"]))
