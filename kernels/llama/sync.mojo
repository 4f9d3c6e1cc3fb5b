# Work sharing between the engine's threads (materl/engines/mojo_forward.py starts them; Mojo
# 1.2.0 has no parallelize, so Python threads call into the same forward pass, each with its
# thread index).
#
# A forward pass is a sequence of phases (embedding, then per layer: q/k/v, attention, output
# projection, MLP up, MLP down; then the LM head and sampling); phase p is cut into chunks that
# can run in any order. Chunks of all phases are numbered in one sequence and handed out by an
# atomic ticket counter: a thread takes the next ticket, waits until every chunk of the earlier
# phases is done (a second counter), runs its chunk and counts it done. So threads never wait
# for each other to *arrive* anywhere, only for work to finish: a thread the OS has descheduled
# while holding no chunk delays nobody (the others take its share), which matters on a shared
# machine. Which thread runs a chunk never changes what the chunk computes (llama/gemm.mojo).

from std.atomic import Atomic, Ordering
from std.ffi import external_call
from std.sys import CompilationTarget, llvm_intrinsic

comptime I64Ptr = Pointer[Int64, MutUntrackedOrigin]

# spins (with the x86 pause hint; plain spins elsewhere) between sched_yield calls while waiting
# for a phase to finish
comptime SPINS_BEFORE_YIELD = 2000
comptime DONE_OFFSET = 8  # the done counter sits a cache line after the ticket counter


struct Tickets:
    """The two counters (int64, zeroed by the caller before the threads start): next ticket and
    chunks done."""

    var ticket: I64Ptr
    var done: I64Ptr

    def __init__(out self, addr: Int):
        self.ticket = I64Ptr(unsafe_from_address=addr)
        self.done = I64Ptr(unsafe_from_address=addr + DONE_OFFSET * 8)

    def take(self) -> Int:
        return Int(Atomic[Int64].fetch_add(self.ticket, 1))

    def finish(self):
        _ = Atomic[Int64].fetch_add(self.done, 1)

    def wait_done(self, count: Int):
        """Return once ``count`` chunks are done (acquire: their writes are visible)."""
        var target = Int64(count)
        var spins = 0
        while Atomic[Int64].load[ordering=Ordering.ACQUIRE](self.done) < target:
            spins += 1
            if spins < SPINS_BEFORE_YIELD:
                comptime if CompilationTarget.is_x86():
                    llvm_intrinsic["llvm.x86.sse2.pause", NoneType]()
            else:
                _ = external_call["sched_yield", Int32]()
                spins = 0
