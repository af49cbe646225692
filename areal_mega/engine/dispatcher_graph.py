"""The autograd graph megatron's MoE token dispatchers keep after a step, released.

megatron-core's token dispatchers keep the last micro-batch's routing probabilities
(``MoEAlltoAllTokenDispatcher.probs``) as an attribute, autograd graph and all. That graph
reaches every earlier parameter's gradient accumulator, whose DDP backward hook holds the DDP
wrapper, which holds the model and so the dispatcher: a reference cycle through C++ autograd
nodes that Python's garbage collector cannot see. An engine that ran one training step was
never freed, nor the process groups its modules hold (each gloo group two live threads), and
a process that built engine after engine (a re-mesh, a test of layouts) piled up hundreds of
groups. The dispatchers keep the values, without the graph, once a schedule has run.
"""

import torch


def release_dispatcher_graphs(chunks) -> None:
    """Replace every tensor attribute with an autograd graph on the MoE token dispatchers of
    ``chunks`` (the engine's model chunks) by its detached value."""
    for chunk in chunks:
        for module in chunk.modules():
            dispatcher = module.__dict__.get("token_dispatcher")
            if dispatcher is None:
                continue
            for name, value in vars(dispatcher).items():
                if torch.is_tensor(value) and value.grad_fn is not None:
                    setattr(dispatcher, name, value.detach())
