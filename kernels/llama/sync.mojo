# A spin-then-yield barrier for the engine's threads (materl/engines/mojo_engine.py starts them;
# Mojo 1.2.0 has no parallelize, so Python threads call into the same forward pass, each with its
# thread index, and meet here between phases).

from std.atomic import Atomic, Ordering
from std.ffi import external_call
from std.sys import llvm_intrinsic

comptime I64Ptr = Pointer[Int64, MutUntrackedOrigin]

# spins (with the x86 pause hint) before each sched_yield: a wait of a few microseconds stays on
# the core; a peer that was descheduled (a busy machine) gets the core back instead of a spinner.
comptime SPINS_BEFORE_YIELD = 4000


struct Barrier:
    """All ``threads`` callers of ``wait`` return only after every one has arrived.

    ``counter`` is an int64 that the caller zeroes before the threads start; each thread counts
    its own barriers (``epoch``), so barrier e is passed when the counter reaches e * threads.
    The atomic add is sequentially consistent and the wait loads with acquire ordering, so every
    write a thread made before the barrier is visible to every thread after it.
    """

    var counter: I64Ptr
    var threads: Int
    var epoch: Int

    def __init__(out self, counter_addr: Int, threads: Int):
        self.counter = I64Ptr(unsafe_from_address=counter_addr)
        self.threads = threads
        self.epoch = 0

    def wait(mut self):
        if self.threads == 1:
            return
        self.epoch += 1
        _ = Atomic[Int64].fetch_add(self.counter, 1)
        var target = Int64(self.epoch * self.threads)
        var spins = 0
        while Atomic[Int64].load[ordering=Ordering.ACQUIRE](self.counter) < target:
            spins += 1
            if spins < SPINS_BEFORE_YIELD:
                llvm_intrinsic["llvm.x86.sse2.pause", NoneType]()
            else:
                _ = external_call["sched_yield", Int32]()
                spins = 0
