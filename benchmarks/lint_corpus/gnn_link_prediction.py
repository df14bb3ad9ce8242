"""Link prediction with a GraphSAGE encoder (PyG style), trained with mixed precision."""
import argparse
from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F


class SAGE(nn.Module):
    def __init__(self, in_channels, hidden, out_channels, num_layers=2, dropout=0.5):
        super().__init__()
        self.lins = nn.ModuleList([nn.Linear(in_channels if i == 0 else hidden, hidden if i < num_layers - 1 else out_channels)
                                   for i in range(num_layers)])
        self.dropout = dropout

    def forward(self, x, adj):
        for i, lin in enumerate(self.lins):
            x = lin(adj @ x)
            if i < len(self.lins) - 1:
                x = F.dropout(F.relu(x), p=self.dropout, training=self.training)
        return x


class LinkPredictor(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.lin1 = nn.Linear(channels, channels)
        self.lin2 = nn.Linear(channels, 1)

    def forward(self, x_i, x_j):
        return self.lin2(F.relu(self.lin1(x_i * x_j))).squeeze(-1)


def train(model, predictor, x, adj, pos_edges, optimizer, batch_size, amp_ctx):
    model.train()
    predictor.train()
    total_loss = 0.0
    bce = nn.BCELoss()
    for perm in torch.randperm(pos_edges.size(0), device=x.device).split(batch_size):
        optimizer.zero_grad()
        with amp_ctx:
            h = model(x, adj)
            edge = pos_edges[perm].t()
            pos_out = torch.sigmoid(predictor(h[edge[0]], h[edge[1]]))
            neg = torch.randint(0, x.size(0), edge.size(), dtype=torch.long, device=x.device)
            neg_out = torch.sigmoid(predictor(h[neg[0]], h[neg[1]]))
            loss = bce(pos_out, torch.ones_like(pos_out)) + bce(neg_out, torch.zeros_like(neg_out))  # expect: AMP003
        loss.backward()
        optimizer.step()
        total_loss += loss.item() * pos_out.size(0)
    return total_loss / pos_edges.size(0)


def train_functional(model, predictor, x, adj, pos_edges, optimizer, scaler, batch_size):
    for perm in torch.randperm(pos_edges.size(0), device=x.device).split(batch_size):
        optimizer.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            h = model(x, adj)
            edge = pos_edges[perm].t()
            pos_logit = predictor(h[edge[0]], h[edge[1]])
        pos_loss = F.binary_cross_entropy(torch.sigmoid(pos_logit), torch.ones_like(pos_logit))  # expect: AMP002
        scaler.scale(pos_loss).backward()
        scaler.step(optimizer)
        scaler.update()


def train_logits(model, predictor, x, adj, pos_edges, optimizer, scaler, batch_size):
    for perm in torch.randperm(pos_edges.size(0), device=x.device).split(batch_size):
        optimizer.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            h = model(x, adj)
            edge = pos_edges[perm].t()
            pos_logit = predictor(h[edge[0]], h[edge[1]])
            loss = F.binary_cross_entropy_with_logits(pos_logit, torch.ones_like(pos_logit))
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


@torch.no_grad()
def test(model, predictor, x, adj, edges, amp_ctx):
    model.eval()
    with amp_ctx:
        h = model(x, adj)
        scores = torch.sigmoid(predictor(h[edges[0]], h[edges[1]]))
        loss = F.binary_cross_entropy(scores, torch.ones_like(scores))  # expect: AMP003
    return scores.float().cpu(), loss.item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--epochs", type=int, default=200)
    args = parser.parse_args()
    device = torch.device("cuda")
    x = torch.randn(10000, 128, device=device)
    adj = torch.eye(10000, device=device)
    pos_edges = torch.randint(0, 10000, (50000, 2), device=device)
    model = SAGE(128, 256, 256).to(device)
    predictor = LinkPredictor(256).to(device)
    optimizer = torch.optim.Adam(list(model.parameters()) + list(predictor.parameters()), lr=0.005)
    amp_ctx = torch.autocast("cuda", dtype=torch.bfloat16) if args.amp else nullcontext()
    for epoch in range(args.epochs):
        loss = train(model, predictor, x, adj, pos_edges, optimizer, 64 * 1024, amp_ctx)
        print(epoch, loss)
    test(model, predictor, x, adj, pos_edges.t(), amp_ctx)
