from prefixflight.specs import PolicySemantics, Unsupported


class MyS3FIFO:  # prefixflight conform --adapter my_s3fifo:MyS3FIFO
    semantics = PolicySemantics(policy="s3fifo", ops=set(), sizing="floor-min-1",
                                max_freq=3, main_evictions="drop")  # fmt: skip

    def __init__(self, capacity, small_ratio, ghost_admit_freq):
        small = max(1, int(capacity * small_ratio))
        if small >= capacity:
            raise Unsupported(f"{capacity} blocks at {small_ratio} leave main no block")
        self.size, self.ghost_freq = {"S": small, "M": capacity - small}, ghost_admit_freq
        self.queues, self.ghost = {"S": {}, "M": {}}, []  # block -> frequency, oldest first

    def resident(self):
        return frozenset(self.queues["S"]) | frozenset(self.queues["M"])

    def access(self, blocks):  # returns the blocks it evicted
        out = []
        for b in blocks:
            if q := next((q for q in self.queues.values() if b in q), None):
                q[b] = min(q[b] + 1, 3)
            else:  # a block the ghost remembers goes straight back into main
                name = "M" if b in self.ghost else "S"
                self.ghost = [g for g in self.ghost if g != b]
                self._push(name, b, self.ghost_freq if name == "M" else 0, out)
        return out

    def _push(self, name, b, freq, out):
        while len(queue := self.queues[name]) >= self.size[name]:
            old = next(iter(queue))
            if (f := queue.pop(old)) and name == "M":
                queue[old] = f - 1  # a second chance
            elif f:
                self._push("M", old, f, out)  # promoted, keeping its frequency
            else:
                out.append(old)
                if name == "S":  # main's victims are forgotten: main_evictions="drop"
                    self.ghost = [*self.ghost, old][-self.size["M"] :]
        self.queues[name][b] = freq
