//! `strata-tiers`: the three-tier expert store (placeholder until its issue lands).
