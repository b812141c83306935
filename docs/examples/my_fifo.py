from prefixflight.specs import PolicySemantics


class MyFIFO:  # prefixflight conform --adapter my_fifo:MyFIFO
    semantics = PolicySemantics(policy="fifo", ops={"evict"})  # no pins, no remove()

    def __init__(self, capacity):
        self.capacity, self.blocks = capacity, {}  # a dict keeps insertion order

    def resident(self):
        return frozenset(self.blocks)

    def evict(self):  # the oldest block, or None
        oldest = next(iter(self.blocks), None)
        self.blocks.pop(oldest, None)
        return oldest

    def access(self, blocks):  # returns the blocks it evicted, in order
        evicted = []
        for b in blocks:
            if b not in self.blocks and self.capacity:
                if len(self.blocks) >= self.capacity:
                    evicted.append(self.evict())
                self.blocks[b] = None
        return evicted
