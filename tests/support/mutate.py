"""Random edits of JSON documents (hypothesis): the values a mutation writes and one edit somewhere in a
document. The checkpoint fuzzers use them."""
from hypothesis import strategies as st


SPECIAL = ["float16", "int64", "bfloat16", "float32", "F16", "I64", "rank-00001.safetensors", "rank-00002.safetensors",
           "../run.json", "model/embed.weight", "model/embed.weight@0,0", "exp_avg/embed.weight", "step-00000002"]


values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.integers(-2**64, 2**64) | st.floats(allow_nan=True)
    | st.text(max_size=6) | st.sampled_from(SPECIAL),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=2),
    max_leaves=4)


def mutate(doc, data):
    """One random edit somewhere in a JSON document: replace, delete, nudge a number, swap two siblings."""
    parent, key, node = None, None, doc
    while isinstance(node, (dict, list)) and node and data.draw(st.integers(0, 4)) > 0:
        keys = sorted(node) if isinstance(node, dict) else list(range(len(node)))
        parent, key = node, data.draw(st.sampled_from(keys))
        node = node[key]
    if parent is None:
        return data.draw(values)
    kind = data.draw(st.sampled_from(["replace", "delete", "nudge", "swap", "add"]))
    siblings = sorted(parent) if isinstance(parent, dict) else list(range(len(parent)))
    if kind == "delete":
        del parent[key]
    elif kind == "nudge" and isinstance(node, int) and not isinstance(node, bool):
        parent[key] = node + data.draw(st.sampled_from([-1, 1, -node - 1, node, 2**40]))
    elif kind == "swap" and len(siblings) > 1:
        other = data.draw(st.sampled_from(siblings))
        parent[key], parent[other] = parent[other], parent[key]
    elif kind == "add" and isinstance(parent, dict):
        parent[data.draw(st.sampled_from(["x", "dtype", "step", "offsets", "sizes", "file", "key"]))] = data.draw(values)
    else:
        parent[key] = data.draw(values)
    return doc

