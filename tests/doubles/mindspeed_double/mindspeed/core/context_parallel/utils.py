"""Double of ``mindspeed.core.context_parallel.utils.RingP2P`` (MindSpeed 028de58).

Mirrors the constructor and the communicator protocol read in MindSpeed's source: the ring
is ``ring_global_ranks``; ``next``/``prev`` are this rank's neighbours (swapped for the
backward ring); an even ring rank posts its send on ``group`` and its receive on
``group_for_send_recv_overlap``, an odd one its receive on ``group`` and its send on the
overlap group. ``async_send_recv`` posts both, ``wait`` completes them. Tensors are plain
tensors (MindSpeed's MLA list form and uneven ``shapes`` are not mirrored). Every posted op
is also recorded in ``posted`` so a test can check that sends and receives pair up.
"""

import torch.distributed as dist


class RingP2P:
    def __init__(self, ring_global_ranks, group, group_for_send_recv_overlap=None, is_backward=False) -> None:
        self.group = group
        self.group_for_send_recv_overlap = group if group_for_send_recv_overlap is None else group_for_send_recv_overlap
        me = dist.get_rank()
        self.ring_rank = ring_global_ranks.index(me)
        size = len(ring_global_ranks)
        self.next = ring_global_ranks[(self.ring_rank + 1) % size]
        self.prev = ring_global_ranks[(self.ring_rank - 1) % size]
        if is_backward:
            self.next, self.prev = self.prev, self.next
        self.send_recv_ops = []
        self.posted = []

    def async_send_recv(self, orig_send_tensor, orig_recv_tensor, shapes=None):
        send_on, recv_on = ((self.group, self.group_for_send_recv_overlap) if self.ring_rank % 2 == 0
                            else (self.group_for_send_recv_overlap, self.group))
        self.posted.append(("send", self.next, send_on))
        self.posted.append(("recv", self.prev, recv_on))
        if self.ring_rank % 2 == 0:
            ops = [dist.isend(orig_send_tensor, self.next, send_on), dist.irecv(orig_recv_tensor, self.prev, recv_on)]
        else:
            ops = [dist.irecv(orig_recv_tensor, self.prev, recv_on), dist.isend(orig_send_tensor, self.next, send_on)]
        self.send_recv_ops.extend(ops)

    def wait(self):
        if not self.send_recv_ops:
            return 0
        for op in self.send_recv_ops:
            op.wait()
        self.send_recv_ops = []
        return 1
