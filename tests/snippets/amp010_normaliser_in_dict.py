"""AMP010 where a variable named ``scaler`` holds a data normaliser kept in a dict."""
import numpy as np
import torch


class StandardScaler:
    def __init__(self, mean, std):
        self.mean, self.std = mean, std

    def transform(self, x):
        return (x - self.mean) / self.std

    def inverse_transform(self, x):
        return x * self.std + self.mean


def load_dataset(path):
    data = {"x_train": np.load(path)}
    scaler = StandardScaler(data["x_train"].mean(), data["x_train"].std())
    data["x_train"] = scaler.transform(data["x_train"])
    data["scaler"] = scaler
    return data


def train(model, loader, optimizer, path):
    data = load_dataset(path)
    scaler = data["scaler"]
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):  # AMP010
            predict = scaler.inverse_transform(model(x))
        loss = (predict.float() - y).abs().mean()
        loss.backward()
        optimizer.step()

