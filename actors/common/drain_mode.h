#pragma once
/// Drain of one scheduler (`tandem inspect --drain`): while draining it tells the router in its
/// credits to route no new work there and finishes what it holds; it counts as clear once the
/// router, having seen it draining, reports that it holds no request for it any more (a
/// credit query with holds = 0), since until then a request routed before the router saw the
/// drain may still arrive. Pure state; the schedulers carry it.
#include <cstdint>

#include <caf/atom.hpp>

namespace tandem {

/// (drain_atom, bool on) -> bool: a role actor starts (on) or stops draining; answers true.
using drain_atom = caf::atom_constant<caf::atom("drain")>;

class drain_mode {
 public:
  void set(bool on) {
    on_ = on;
    router_clear_ = false;
  }
  bool draining() const { return on_; }
  /// A credit query from the router: `holds` requests it still has here, -1 if it has not
  /// seen this target draining yet.
  void on_query(int32_t holds) { router_clear_ = on_ && holds == 0; }
  /// 1 while draining and the router has confirmed it routes nothing here any more, else 0.
  bool router_clear() const { return on_ && router_clear_; }

 private:
  bool on_ = false;
  bool router_clear_ = false;
};

}  // namespace tandem
