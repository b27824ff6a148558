"""scalify.core.lru.LRUCache: the bounded caches of traced jaxprs and re-wrapped jits."""
import pytest

from scalify.core.lru import LRUCache


def test_evicts_the_least_recently_used_entry():
    c = LRUCache(2)
    c.put("a", 1)
    c.put("b", 2)
    assert c.get("a") == 1  # "a" is now the most recent
    c.put("c", 3)
    assert (c.get("b"), c.get("a"), c.get("c"), len(c)) == (None, 1, 3, 2)
    c.put("a", 4)  # replacing keeps the size
    assert (c.get("a"), len(c)) == (4, 2)
    c.clear()
    assert len(c) == 0


def test_unhashable_key_raises_type_error():
    with pytest.raises(TypeError):
        LRUCache(1).get([1])
