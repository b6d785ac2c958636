"""A transfer is visible to other threads while its pieces are being
submitted (the store's in-flight list, its key's pending list). Completing it
from another thread then must wait for the submission: finishing it early
returned before the bytes moved (an update read moments still being read:
NaN and wrong values in an NVMe-offloaded run with overlap="backward") and
leaked the staging buffer taken after (the next staged transfer then waited
600 s for the pool)."""

import threading

import pytest
import torch
from test_io_swap_store import BACKENDS, make_store, rand_bytes, unaligned

from infinity.io.swap import transfer as swap_transfer


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["read", "write"])
def test_a_transfer_being_submitted_is_not_completed_by_another_thread(tmp_path, backend, op, monkeypatch):
    x = rand_bytes(3 * 4096 + 100, seed=4)
    with make_store(tmp_path, backend, block_size=4096, staging_bytes=8192) as store:
        store.write("k", x if op == "read" else torch.zeros_like(x)).wait()
        took, go = threading.Event(), threading.Event()
        real_stage = swap_transfer.Transfers._stage

        def paused_stage(self, nbytes, exclude):
            buf = real_stage(self, nbytes, exclude)
            if exclude.op == op:  # staging taken, its request not submitted yet
                took.set()
                assert go.wait(300)
            return buf

        monkeypatch.setattr(swap_transfer.Transfers, "_stage", paused_stage)
        y = unaligned(torch.zeros_like(x))
        handles = []
        submit = (lambda: handles.append(store.read("k", y))) if op == "read" else \
            (lambda: handles.append(store.write("k", unaligned(x))))
        submitter = threading.Thread(target=submit)
        submitter.start()
        assert took.wait(300)
        (h,) = store._transfers.pending()
        assert not h.done(), "a transfer still being submitted is not done"
        completer = threading.Thread(target=h._complete)
        completer.start()
        completer.join(0.3)
        assert completer.is_alive(), "another thread's _complete() waits for the submission"
        go.set()
        submitter.join(300)
        completer.join(300)
        assert not completer.is_alive() and handles and handles[0] is h
        h.wait()
        monkeypatch.undo()
        if op == "write":
            store.read("k", y).wait()
        assert torch.equal(y, x), "the bytes moved before the transfer was done"
        assert store._pool.used_bytes == 0, "no staging buffer kept by a finished transfer"
