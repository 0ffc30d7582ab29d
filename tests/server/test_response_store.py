"""The stored responses' bounds and owners, without a server."""

from __future__ import annotations

from tokenmill.entrypoints.responses.store import ResponseStore, owner_of


def put(store: ResponseStore, owner: str, rid: str, text: str = "x") -> None:
    store.put(owner, {"id": rid, "output": text}, [], [])


def test_count_bound_evicts_the_least_recently_used():
    store = ResponseStore(max_responses=2)
    put(store, "a", "r1")
    put(store, "a", "r2")
    assert store.get("a", "r1") is not None  # r1 is now the most recent
    put(store, "a", "r3")
    assert store.get("a", "r2") is None and store.get("a", "r1") is not None and len(store) == 2


def test_byte_bound_and_an_entry_larger_than_the_store():
    store = ResponseStore(max_bytes=200)
    put(store, "a", "big", "y" * 500)
    assert store.get("a", "big") is None and store.num_bytes == 0
    for k in range(10):
        put(store, "a", f"r{k}", "z" * 40)
    assert store.num_bytes <= 200 and store.get("a", "r9") is not None and store.get("a", "r0") is None


def test_owners_never_see_each_other():
    store = ResponseStore()
    alice, bob = owner_of("key-alice"), owner_of("key-bob")
    put(store, alice, "r1")
    assert store.get(bob, "r1") is None and not store.delete(bob, "r1") and store.get(alice, "r1") is not None
    assert owner_of(None) == "" and alice != bob and "key-alice" not in alice
    assert store.delete(alice, "r1") and store.num_bytes == 0
