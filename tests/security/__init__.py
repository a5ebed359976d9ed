"""Tests that act as an attacker: another Ray job of the same cluster going after a group."""
