import pytest

from fivefold.config import ConfigError, ParallelConfig
from fivefold.grid import Widths
from fivefold.mesh import GROUP_SPECS, ParallelMesh, coords, grid_sizes, rank_groups, spec_groups

LAYOUTS = [
    dict(tp=2, dp=4, pp=2, ep=2),
    dict(tp=2, cp=2, dp=2, pp=2, ep=4),
    dict(tp=4, dp=2),
    dict(dp=8),
    dict(tp=2, cp=2, dp=2, pp=2, ep=2, order="tp-dp-cp-ep-pp"),
    dict(pp=4, dp=2, order="pp-dp-tp-cp-ep"),
    dict(tp=4, cp=4, pp=4, order="cp-tp-ep-dp-pp"),
    dict(tp=2, dp=2, ep=4),                           # MoE parallel folding: ep over tp and dp
    dict(tp=4, dp=2, pp=2, ep=2, etp=2),              # etp inside tp, ep over tp and dp
    dict(tp=2, cp=2, dp=2, pp=2, ep=8),               # ep over every rank of a stage
    dict(tp=2, dp=4, ep=2, etp=4),                    # etp beyond tp
]
WIDTHS = Widths(ulysses=2, kv_replicas=2)   # hybrid CP's Ulysses runs, K/V heads on two tp ranks each


@pytest.mark.parametrize("layout", LAYOUTS)
def test_groups_partition_world(layout):
    p = ParallelConfig(**layout)
    dense, expert = grid_sizes(p)
    order = p.order.split("-")
    world = set(range(p.world_size))
    for name, spec in GROUP_SPECS.items():
        sizes = dense if spec.grid == "dense" else expert
        groups = spec_groups(p, name, order, WIDTHS)
        flat = [r for g in groups for r in g]
        assert sorted(flat) == sorted(world), name            # a partition: every rank once
        size = 1
        for d in spec.dims:
            size *= sizes[d]
        if not spec.split:
            assert all(len(g) == size for g in groups), name    # the right size
            assert groups == rank_groups(sizes, order, spec.dims), name


@pytest.mark.parametrize("layout", LAYOUTS)
def test_innermost_is_contiguous(layout):
    p = ParallelConfig(**layout)
    order = p.order.split("-")
    dense, _ = grid_sizes(p)
    inner = next(d for d in order if dense[d] > 1)
    for g in rank_groups(dense, order, (inner,)):
        assert g == list(range(g[0], g[0] + len(g)))


def test_docstring_example_rank5():
    p = ParallelConfig(tp=2, dp=4, pp=2, ep=2)
    mesh = ParallelMesh(p, rank=5)
    assert mesh["tp"].ranks == [4, 5]
    assert mesh["dp"].ranks == [1, 3, 5, 7]
    assert mesh["pp"].ranks == [5, 13]
    assert mesh["ep"].ranks == [4, 5]                 # folded onto the tp pair (etp 1)
    assert mesh["edp"].ranks == [1, 3, 5, 7]
    assert mesh["etp"].ranks == [5]
    assert mesh.coords["tp"] == 1 and mesh.coords["dp"] == 2 and mesh.coords["pp"] == 0
    assert mesh.coords["ep"] == 1 and mesh.coords["edp"] == 2 and mesh.coords["etp"] == 0
    cut = ParallelMesh(ParallelConfig(tp=2, dp=4, pp=2, ep=2, etp=2), rank=5)
    assert (cut["etp"].ranks, cut["ep"].ranks, cut["edp"].ranks) == ([4, 5], [5, 7], [1, 5])
    assert mesh["mp"].ranks == [4, 5, 12, 13]
    assert coords(5, grid_sizes(p)[0], p.order.split("-"))["dp"] == 2


def test_embedding_group_joins_first_and_last_stage():
    """Tied embeddings: the first and last rank of every pp group; middle stages are alone."""
    p = ParallelConfig(tp=2, dp=2, pp=4)          # pp stride 4: pp groups [r, r+4, r+8, r+12]
    assert ParallelMesh(p, rank=1)["embed"].ranks == [1, 13]
    assert ParallelMesh(p, rank=13)["embed"].ranks == [1, 13]
    assert ParallelMesh(p, rank=13)["embed"].rank == 1
    assert ParallelMesh(p, rank=6)["embed"].ranks == [6]    # stage 1 holds no embedding
    two = ParallelMesh(ParallelConfig(dp=2, pp=2), rank=3)
    assert two["embed"].ranks == two["pp"].ranks == [1, 3]
    assert ParallelMesh(ParallelConfig(dp=2), rank=1)["embed"].ranks == [1]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_planner_places_the_groups_the_mesh_makes(layout):
    """fivefold.grid is shared: the planner's group sizes are the mesh's, and each group lies inside one
    aligned block of `group_block` consecutive ranks (what decides the network tier it crosses)."""
    from fivefold.grid import group_block, group_size

    p = ParallelConfig(**layout)
    widths = Widths(ulysses=2 if p.cp % 2 == 0 else 1, kv_replicas=2 if p.tp > 2 else 1)
    for rank in (0, p.world_size - 1):
        mesh = ParallelMesh(p, rank=rank, ulysses=widths.ulysses, kv_replicas=widths.kv_replicas)
        assert set(mesh.groups) == {n for n, s in GROUP_SPECS.items() if s.exists(p, widths)}
        for name in mesh.groups:
            g = mesh[name].ranks
            block = group_block(p, name, p.order, widths)
            assert len(g) == group_size(p, name, widths) or (name == "embed" and len(g) == 1), name
            assert len({r // block for r in g}) == 1 and len(g) <= block, (name, g, block)
    assert mesh["world"].ranks == list(range(p.world_size))


def test_orders_whose_expert_grid_splits_stages_are_refused():
    """tp2 x pp2 x dp2 with ep2 in an order that put pp 4 ranks apart on the expert grid and 2 on the dense
    grid hung: an expert all-to-all joined ranks of different stages. Such orders are refused in one line;
    every order accepted gives each rank the same pp coordinate on both grids, so each expert group lies
    inside one stage (its tp coordinate may differ: the experts fold over tp's ranks)."""
    import itertools

    from fivefold.grid import check_grids_agree, coords, grid_sizes

    with pytest.raises(ConfigError, match=r"parallel.order 'tp-pp-cp-ep-dp' gives pp a stride of 2 ranks on the dense "
                                          r"grid and 1 on the expert grid"):
        ParallelConfig(tp=2, pp=2, dp=2, ep=2, order="tp-pp-cp-ep-dp").validate(8)
    for degrees in (dict(tp=2, pp=2, dp=2, ep=2), dict(tp=2, pp=2, cp=2, dp=2, ep=4), dict(pp=2, dp=4, ep=2),
                    dict(tp=2, pp=2, dp=2, ep=2, etp=2), dict(tp=2, pp=2, dp=2, ep=4)):
        p = ParallelConfig(**degrees)
        dense, expert = grid_sizes(p)
        accepted = 0
        for dims in itertools.permutations(("tp", "cp", "ep", "dp", "pp")):
            try:
                check_grids_agree(p, list(dims))
            except ConfigError:
                continue
            accepted += 1
            for r in range(p.world_size):
                assert coords(r, dense, list(dims))["pp"] == coords(r, expert, list(dims))["pp"], (dims, r)
        assert 0 < accepted <= 120


def test_the_expert_grid_folds_over_tp_cp_and_dp():
    """etp · ep · edp = tp · cp · dp; ep may use the ranks tp and cp occupy, not only dp's."""
    for degrees, ep_group, etp_group, edp_group in (
            (dict(tp=2, dp=2, ep=4), [0, 1, 2, 3], [0], [0]),
            (dict(tp=2, dp=2, ep=2), [0, 1], [0], [0, 2]),
            (dict(tp=2, dp=2, ep=2, etp=2), [0, 2], [0, 1], [0]),
            (dict(tp=2, cp=2, ep=4), [0, 1, 2, 3], [0], [0]),
            (dict(tp=4, dp=2, ep=2, etp=2), [0, 2], [0, 1], [0, 4])):
        mesh = ParallelMesh(ParallelConfig(**degrees), rank=0)
        assert (mesh["ep"].ranks, mesh["etp"].ranks, mesh["edp"].ranks) == (ep_group, etp_group, edp_group), degrees
    with pytest.raises(ConfigError, match=r"etp x ep \(1 x 8\) must divide tp\*cp\*dp \(4\)"):
        ParallelConfig(tp=2, dp=2, ep=8).validate(4)
