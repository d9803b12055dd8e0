"""Measuring memory: methods x budgets against full KV or against gold answers, QA sets and their scoring,
reports."""
