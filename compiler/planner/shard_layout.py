"""The planner's tensor-parallel shard lines: Megatron's pairs in the blocks, and the
vocabulary (embedding rows and LM head) when the model has one.

- `megatron_layout`: a Linear inside a block is `row` when every Linear whose
  output reaches its input (without passing another Linear) is `col`, else
  `col`: q, k, v → o and gate, up → down; fc1 → fc2. A model input reaches no
  Linear's count: an attention mask or a gate made from an input, mixed into a
  col layer's output, leaves the row layer after it row.
- `shard_lines`: `shard layers[*].attn.q col tp` where every block of a list
  agrees, else one line per module.
- `vocab_lines`: `shard <embedding> vocab tp` and `shard <head> col tp` for the
  Embedding that looks a model input up and a Linear after which no parameter is
  read (the LM head, compiler/passes/tp_padding.py `feeds_only_the_loss`), found in
  the graph; with the default loss its logits then stay sharded into the loss
  (loss parallel). A vocabulary tp does not divide is padded (compiler/layout.py).
"""

from __future__ import annotations

import torch
import torch.fx

from parc.dsl import parse_spec
from parc.dsl.ast import ShardKind

from ..blocks import Blocks
from ..cost import tensor_metas
from ..linear_forms import linear_form
from ..passes.tp_analysis import analyse_tensor_parallel
from ..passes.tp_padding import check_padding
from ..plan import Plan
from ..resolve import resolve

__all__ = ["SEQUENCE_LINE", "analyse_lines", "megatron_layout", "shard_lines", "vocab_lines"]

SEQUENCE_LINE = "sequence_parallel tp"  # activations between blocks sharded on the sequence


def megatron_layout(
    gm: torch.fx.GraphModule, unit_of: dict[str, str], blocks: set[str]
) -> dict[str, ShardKind]:
    """Step 3: module name -> col or row for the Linears inside blocks."""
    layout: dict[str, ShardKind] = {}
    feeds: dict[torch.fx.Node, frozenset[object]] = {}  # kinds of the nearest Linears
    for node in gm.graph.nodes:
        ins = [a for a in node.all_input_nodes if a in feeds]
        reaching = frozenset().union(*(feeds[a] for a in ins)) if ins else frozenset()
        linear = (
            node.op == "call_module" and linear_form(gm.get_submodule(str(node.target))) is not None
        )
        if node.op == "placeholder":
            feeds[node] = frozenset()  # replicated data: it keeps a col output sharded
        elif linear and unit_of[node.name] in blocks:
            kind = ShardKind.ROW if reaching == {ShardKind.COL} else ShardKind.COL
            layout[str(node.target)] = kind
            feeds[node] = frozenset({kind})
        elif linear:
            feeds[node] = frozenset({None})
        elif node.op != "get_attr" and any(True for _ in tensor_metas(node)):
            feeds[node] = reaching  # sizes and parameters carry no data between Linears
    return layout


def shard_lines(
    layout: dict[str, ShardKind], model: torch.nn.Module, blocks: Blocks
) -> tuple[str, ...]:
    """`shard layers[*].attn.q col tp` where every block of a list agrees, else one per module."""
    by_suffix: dict[tuple[str, str, ShardKind], list[str]] = {}
    for name, kind in layout.items():
        block = blocks.block_of(name)
        assert block is not None  # the layout covers Linears inside blocks only
        lst, _, index = block.rpartition(".")
        suffix = name[len(block) + 1 :]
        by_suffix.setdefault((lst, suffix, kind), []).append(index)
    lines = []
    for (lst, suffix, kind), indices in by_suffix.items():
        container = model.get_submodule(lst)
        if len(indices) == len(list(container.children())):
            lines.append(f"shard {blocks.every(lst)}{'.' + suffix if suffix else ''} {kind} tp")
        else:
            lines += [f"shard {lst}.{i}{'.' + suffix if suffix else ''} {kind} tp" for i in indices]
    return tuple(lines)


def vocab_lines(gm: torch.fx.GraphModule) -> tuple[str, ...]:
    """The vocab-parallel shard lines of the graph's embedding and LM head (see above):
    the widest embedding an input looks up (a BERT's word embeddings, not its token
    types), the head when its outputs are that embedding's rows (an LM head, not a
    classifier over a few labels) or no embedding is looked up; none without either."""
    lines: list[str] = []
    tables = [
        (module.num_embeddings, str(node.target))
        for node in gm.graph.nodes
        if node.op == "call_module"
        and isinstance(module := gm.get_submodule(str(node.target)), torch.nn.Embedding)
        and _is_input(node.args[0])
        and not _options(module)
    ]
    rows, table = max(tables, default=(None, ""))
    if table:
        lines.append(f"shard {table} vocab tp")
    last = _feeds_only_the_loss(gm)
    heads = [
        (form.out_features, str(n.target))
        for n in gm.graph.nodes
        if n.op == "call_module"
        and (form := linear_form(gm.get_submodule(str(n.target)))) is not None
        and last[str(n.target)]
    ]
    if len(heads) == 1 and rows in (None, heads[0][0]):
        lines.append(f"shard {heads[0][1]} col tp")
    return tuple(dict.fromkeys(lines))


def _feeds_only_the_loss(gm: torch.fx.GraphModule) -> dict[str, bool]:
    """tp_padding.feeds_only_the_loss of every called module in one backward pass over the
    graph (it walks the rest of the graph per module): whether no node after any call of
    it reads a parameter (a get_attr of one, or a module holding any)."""
    params = {name for name, _ in gm.named_parameters(remove_duplicate=False)}

    def reads(node: torch.fx.Node) -> bool:
        if any(a.op == "get_attr" and str(a.target) in params for a in node.all_input_nodes):
            return True
        module = gm.get_submodule(str(node.target)) if node.op == "call_module" else None
        return module is not None and next(module.parameters(), None) is not None

    before_a_read: set[torch.fx.Node] = set()  # nodes with a reading node after them
    for node in reversed(gm.graph.nodes):  # users come after their inputs
        if any(reads(u) or u in before_a_read for u in node.users):
            before_a_read.add(node)
    out: dict[str, bool] = {}
    for node in gm.graph.find_nodes(op="call_module"):
        target = str(node.target)
        out[target] = out.get(target, True) and node not in before_a_read
    return out


def _is_input(value: object) -> bool:
    return isinstance(value, torch.fx.Node) and value.op == "placeholder"


def _options(module: torch.nn.Embedding) -> bool:
    """Options `vocab` sharding refuses (compiler/resolve.py)."""
    return module.max_norm is not None or module.scale_grad_by_freq or module.sparse


def analyse_lines(
    gm: torch.fx.GraphModule,
    model: torch.nn.Module,
    lines: tuple[str, ...],
    tp: int,
    loss_parallel: bool = False,
) -> tuple[Plan, int]:
    """Step 4: the tensor-parallel analysis at `tp` (writes node.meta); how many warnings.
    A padded vocabulary whose padding could reach user code is a PlanError, as in the
    front end."""
    spec = parse_spec(f"mesh tp={tp}\n" + "".join(f"{line}\n" for line in lines))
    plan = resolve(spec, model, gm, batch=1)
    found = analyse_tensor_parallel(gm, plan, spec, loss_parallel=loss_parallel)
    check_padding(gm, plan, spec)
    return plan, len(found)
