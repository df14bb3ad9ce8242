"""Graph property prediction; precision picked with `match` (Python 3.10)."""
import argparse
import contextlib

import torch
import torch.nn.functional as F
from torch_geometric.loader import DataLoader
from torch_geometric.nn import GINConv, global_add_pool

from graph_data import load_split


class GIN(torch.nn.Module):
    def __init__(self, dim=300, layers=5, tasks=128):
        super().__init__()
        self.convs = torch.nn.ModuleList(
            GINConv(torch.nn.Sequential(torch.nn.Linear(dim, dim), torch.nn.ReLU(), torch.nn.Linear(dim, dim)))
            for _ in range(layers)
        )
        self.head = torch.nn.Linear(dim, tasks)

    def forward(self, x, edge_index, batch):
        for conv in self.convs:
            x = F.relu(conv(x, edge_index))
        return self.head(global_add_pool(x, batch))


def main(args):
    match args.precision:
        case "fp16":
            ctx = torch.autocast("cuda", dtype=torch.float16)  # expect: AMP010
        case "bf16":
            ctx = torch.autocast("cuda", dtype=torch.bfloat16)
        case _:
            ctx = contextlib.nullcontext()
    model = GIN().cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    train_set, valid_set = load_split(args.dataset)
    loader = DataLoader(train_set, batch_size=256, shuffle=True)
    for epoch in range(args.epochs):
        model.train()
        for data in loader:
            data = data.cuda()
            with ctx:
                out = model(data.x, data.edge_index, data.batch)
                valid = ~torch.isnan(data.y)
                loss = F.binary_cross_entropy_with_logits(out[valid], data.y[valid])
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
        print(f"epoch {epoch}: loss {loss.item():.4f}")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--dataset", default="ogbg-molpcba")
    p.add_argument("--precision", default="bf16", choices=["fp16", "bf16", "fp32"])
    p.add_argument("--epochs", type=int, default=100)
    main(p.parse_args())
